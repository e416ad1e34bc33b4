"""torchrun in-process with hpctrain's handling, and workers forked from the launcher.

- torchrun: the launch (argument defaults, the log folder, the oversubscription warning);
- signals: stop signals forwarded to the workers, and the launcher's kills after their grace;
- failures: the one-line failure report, its exit code and alert;
- arguments: torchrun's arguments for a local launch, and the thread-count check;
- fork_safety, forked_workers: when the workers may be forks of the launcher, and the forks themselves.

Below the commands and the training (layer 6 that imports only config, dist, fault, monitor and foundation
modules): the caller says which modules to import before forking and how to read the run's config.
"""
