"""Planning: the dataset's and each run's plan (`ctseg.plan`), built once from the dataset and
the configuration before any step runs."""
