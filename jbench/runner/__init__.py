"""The run layer: a device held through a DeviceSession, one trial run through its stages by the TrialRunner,
trials spread over devices by the Scheduler, runs written by the Recorder. Every workflow (jbench.sweeps) runs
trials through it."""
