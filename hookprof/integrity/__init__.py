"""Silent data corruption: checks that the training state is what it must be, beyond NaN."""
