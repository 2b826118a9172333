"""`python -m jrope.compare`: the method x seed comparison (jrope.experiments.compare)."""

if __name__ == "__main__":
    # Imported here: `import jrope.compare` must not load the training harness.
    from jrope.experiments.compare import run_main

    run_main()
