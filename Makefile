# Set-up is incremental: the venv is made once (stamp), the corpus only when missing.
#   make train   train the default debug model on the embedded corpus: CoLA + BTP over 2
#                ranks (2+ GPUs, or 2 CPU ranks without a GPU), CoLA on 1 process with
#                one GPU (run_train.sh picks; NGPU=... / CONFIG_FILE=... override)
#   make test    run the whole test suite
#   make eval MODEL=DIR   lm-eval perplexity of an exported Hugging Face folder on the
#                validation split (boost-titan eval; ARGS=... adds options)
#   make lint    ruff lint + format check (CI runs it before the tests)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.boost-installed

.PHONY: setup data train test eval lint format clean-outputs

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: the local CPU wheel here, the CUDA build on GPU machines
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev,hf,ft]"
	@touch $(STAMP)

setup: $(STAMP)

data: $(STAMP)
	$(VENV)/bin/boost-titan data build

train: data
	./run_train.sh $(ARGS)

# two workers, each a whole file at a time (its module fixtures built once), in xdist's
# order (the files with the most tests first): about half the suite is one process on
# one core (tests/README.md)
TEST_WORKERS ?= 2
test: data
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests --durations=30 $(ARGS)

eval: data
	@test -n "$(MODEL)" || { echo 'make eval: set MODEL=<exported Hugging Face folder>'; exit 2; }
	$(VENV)/bin/boost-titan eval --model $(MODEL) $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check boost_titan tests benchmarks
	$(PY) -m ruff format --check boost_titan tests benchmarks

format: $(STAMP)
	$(PY) -m ruff check --fix boost_titan tests benchmarks
	$(PY) -m ruff format boost_titan tests benchmarks

clean-outputs:
	rm -rf outputs
