"""Real workloads that ship with installed packages: data and models for training runs."""
