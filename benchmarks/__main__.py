"""``python -m benchmarks [--quick] [--only estimator,collectives,step]``."""

from benchmarks.run import main

if __name__ == "__main__":  # multiprocessing (forkserver) re-imports the main module
    raise SystemExit(main())
