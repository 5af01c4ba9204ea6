"""The convenience trainer: config, loop, checkpoints, metrics. Not required to use the strategies."""
