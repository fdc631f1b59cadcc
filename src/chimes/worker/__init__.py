"""Worker side of chimes: claims runs and executes their tasks."""
