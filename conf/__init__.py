# jbench's packaged Hydra config tree. Installed as the package `jbench.conf` (see pyproject.toml)
# so that Hydra finds it as pkg://jbench.conf from a wheel as well as from a checkout.
