# voxdiff: `make demo` runs the whole pipeline on the built-in data; `make test` runs the tests.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(CURDIR)/$(VENV)/bin
STAMP := $(VENV)/.installed-stamp
# pip on some machines prints one warning per unreachable local index: keep the output readable. The braces keep
# `|| true` to grep (which fails when it filters every line): under pipefail a failing pip still fails the recipe.
QUIET_PIP := { grep -v -e 'is ignored: it is neither a file nor a directory' || true; }
export PATH := $(BIN):$(PATH)
# What the demo tells you to try next, as it prints it: full paths, so they run without activating .venv
# (stages re-run themselves with .venv's python: stages/_entry.py). tests/test_e2e_dvc.py runs TRY_EXP.
TRY_EXP := $(BIN)/dvc exp run -S train.accumulate_every=4
TRY_COMPARE := $(BIN)/voxdiff compare --out reports/compare.md
MLFLOW_UI := $(BIN)/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlflow.db
# What to commit to make the demo's run the baseline experiments are compared to: DVC's convention, the
# lock file and the `cache: false` metrics and plots the pipeline writes (models, data and samples are
# DVC outputs, ignored by git). tests/test_e2e_dvc.py runs it and checks that nothing is left untracked.
BASELINE := git add dvc.lock metrics plots && git commit -m "demo baseline"

.PHONY: demo test test-profile bench sweep study study-report study-advise ui-shot doctor docs lock clean-outputs help

help:
	@echo "make demo   - set up .venv, run the pipeline (dvc repro) on the built-in data, show metrics"
	@echo "make test   - set up .venv if needed and run the test suite"
	@echo "make test-profile - make test, then the tests that wait most and compute most (wall and CPU time each)"
	@echo "make bench  - side-by-side benchmarks -> benchmarks/results.json, RESULTS.md"
	@echo "make sweep  - queue accumulate_every x seed experiments, run them, compare"
	@echo "make study  - run (or continue) the study's grid, archive runs in docs/study/runs, rebuild reports"
	@echo "make study-report - rebuild docs/study/*.md from the archive alone (no MLflow needed)"
	@echo "make study-advise - an N 160 k 1 study run with voxdiff advise at three phases beside it (2 cores; the advice in ~75 min)"
	@echo "make ui-shot - screenshot of the MLflow UI's run comparison (headless Chromium) -> docs/mlflow-compare.png"
	@echo "make doctor - device, precision, versions, tracking store (for bug reports)"
	@echo "make docs   - regenerate docs/params.md from params.py's schema and params.yaml's comments"

$(STAMP): requirements.lock pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check -c requirements.lock torch==2.13.0 2>&1 | $(QUIET_PIP)
	$(BIN)/python -m pip install -q --disable-pip-version-check -c requirements.lock -e '.[test]' 2>&1 | $(QUIET_PIP)
	$(BIN)/python -c "import torch, monai, mlflow, dvc, nibabel, nilearn, voxdiff"
	touch $(STAMP)

# A copy without git history (a tarball) gets a first commit; one whose commit failed before (no git identity) gets
# it on the next try, so the demo's baseline commit never holds only dvc.lock.
demo: $(STAMP)
	@{ test -e .git && git rev-parse -q --verify HEAD >/dev/null 2>&1; } || (git init -q && git add -A && git commit -qm "voxdiff: initial")
	@start=$$(date +%s); $(BIN)/dvc repro; echo "pipeline: $$(( $$(date +%s) - start )) s"
	@echo; echo "== metrics (every field: metrics/train_detail.json, metrics/eval_detail.json) =="; $(BIN)/voxdiff metrics
	@echo; echo "Open MLflow:  $(MLFLOW_UI)   (then http://127.0.0.1:5000, experiment voxdiff:"
	@echo "             Views (top right) > 'accumulate_every at equal samples (voxdiff)', then the chart button)"
	@echo "Look at:     plots/eval/*.png (generated volumes next to the real one), plots/convergence.png"
	@echo 'Baseline:    $(BASELINE)   (what dvc exp show and dvc plots diff compare experiments to)'
	@echo "Try:         $(TRY_EXP)   and   $(TRY_COMPARE)"

# One xdist worker per core and one more (tests/conftest.py: the slowest start first, tests sharing a module's fixture run on one
# worker); the 10 slowest tests are listed at the end. Exit 5 (no test collected) fails, and says so.
test: $(STAMP)
	$(BIN)/python -m pytest -q -n auto --dist loadgroup --no-loadscope-reorder --durations=10 || { rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests (exit 5)" >&2; fi; exit $$rc; }

# make test, with each test's wall and CPU time (tests/conftest.py): where the suite's time goes.
test-profile: $(STAMP)
	VOXDIFF_TEST_PROFILE=$(CURDIR)/.test-profile.jsonl $(MAKE) --no-print-directory test

bench: $(STAMP)
	$(BIN)/python benchmarks/run.py

sweep: $(STAMP)
	@mkdir -p reports
	JOBS=$${JOBS:-1} EXPS_FILE=reports/sweep.exps bash docs/study/wait_queue.sh \
	  -S 'train.accumulate_every=1,2,4,8' -S 'seed=0,1,2'
	$(BIN)/voxdiff compare --out reports/sweep.md $$(sed 's/^/--dvc-exp /' reports/sweep.exps)

study: $(STAMP)
	bash docs/study/run.sh

study-report: $(STAMP)
	bash docs/study/report.sh

study-advise: $(STAMP)
	bash docs/study/advise_phases.sh

ui-shot: $(STAMP)
	bash docs/ui-shot.sh

doctor: $(STAMP)
	$(BIN)/voxdiff doctor

docs: $(STAMP)
	$(BIN)/python -m voxdiff.paramsdoc --out docs/params.md

lock:
	@test -x $(BIN)/python || { echo "make lock: no .venv to freeze yet (make $(STAMP) first)" >&2; exit 1; }
	$(BIN)/python -m pip freeze --exclude-editable | sed 's/^torch==\(.*\)+cpu/torch==\1/' > requirements.lock.new
	mv requirements.lock.new requirements.lock
