"""What a user runs: training runs, comparisons."""
