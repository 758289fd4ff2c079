"""Core types every layer shares: config schemas, trials, results, identity, metrics, exit codes, paths and
the plug-in registry. Nothing here imports another jbench package."""
