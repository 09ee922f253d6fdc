"""TRACE's benchmarks: one script per measurement (bench/README.md lists them, what each measures and the doc
section it feeds); `bench.common` holds the timing and reporting helpers they share. Run a bench from the checkout
as `python bench/<name>.py`."""
