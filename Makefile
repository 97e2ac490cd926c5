# Two entry points: `make demo` runs the pipeline on generated data, `make test` runs the tests.
# Both create and use the local virtual environment .venv (Python 3.11+).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Rules call the `ctseg` command, so the environment's bin/ must be on PATH for snakemake.
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: demo test test-fast lint bench clean browser slurm

# torch first, on its own: pip then takes the machine's CPU wheel (2.13.0+cpu), which the
# project's ==2.13.0 pin accepts; resolved together with the rest it picks the PyPI build and
# gigabytes of CUDA libraries.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/snakemake

# The report test opens the page in a real headless Chromium (Debian's package). CI and root
# shells install it; without root the report's browser check is skipped, saying how to run it.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
		if [ -z "$$CI" ] && [ "$$(id -u)" != 0 ]; then \
			echo "chromium missing and not root: the report's browser check will be skipped"; \
		else \
			echo "installing chromium for the report's browser test (apt-get)"; \
			apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
				chromium fonts-dejavu-core >/dev/null; \
		fi; }

# tests/test_slurm_cluster.py starts a one-node SLURM cluster (Debian's slurm-wlm and munge, run
# as plain processes). CI and root shells install them; without root that test is skipped,
# saying how to run it.
slurm:
	@command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 || { \
		if [ "$$(id -u)" != 0 ]; then \
			echo "slurm-wlm/munge missing and not root: the real-SLURM test will be skipped"; \
		else \
			echo "installing slurm-wlm and munge for the real-SLURM test (apt-get)"; \
			apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
				slurm-wlm munge >/dev/null; \
		fi; }

test: $(STAMP) browser slurm
	$(BIN)/python -m pytest -q

# The fast tier for development: unit tests without real snakemake runs, DDP or the phase
# matrix (under 2 minutes on 2 cores). CI runs `make test`, everything.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check workflow/ctseg tests bench
	$(BIN)/snakefmt --check workflow/Snakefile workflow/rules
	$(BIN)/snakemake --lint

bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python bench/preprocess.py --quick
	$(BIN)/python bench/loader.py --quick
	$(BIN)/python bench/train.py --quick
	$(BIN)/python bench/infer.py --quick

clean:
	rm -rf results .snakemake
