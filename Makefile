# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv themselves.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: install demo test test-slow docs measure clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,ray,parquet,llm]'
	touch $(STAMP)

install: $(STAMP)

# The headline reproduction: linattn Fig 1 at the paper's settings, its figure and its checks,
# then the browsable report of the result store (its index path is printed last).
demo: $(STAMP)
	$(BIN)/iclab run linattn.fig1 --preset paper
	$(BIN)/iclab report

# The layer contracts of pyproject.toml first (import-linter), then the tests on every core (pytest-xdist), one
# test module per worker (--dist loadscope keeps a module's fixtures in one process).
test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n auto --dist loadscope

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow -n auto --dist loadscope

# The documentation site into site/ (open site/index.html; it fetches nothing at view time): mkdocs in strict
# mode, the seven tutorials of docs/tutorials/ executed (a failed theory assert fails the build), the maths
# rendered by KaTeX (brought in once by npm, pinned by version and sha256 in docs/_hooks/iclab_docs.py; needs
# node and npm). The docs extra is installed beside the others.
DOCS_STAMP := $(VENV)/.docs-stamp

$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --clean

# Measurements as data: every quick preset and every benchmark, each in a fresh process, into one record under
# docs/measurements/ (commit it); then the README's experiments table regenerated from the records. Long on a small
# machine (tens of minutes); MEASURE_ARGS narrows it, e.g. make measure MEASURE_ARGS='--only linattn.fig1 --no-bench'.
MEASURE_ARGS ?=

measure: $(STAMP)
	$(BIN)/iclab measure $(MEASURE_ARGS)
	$(BIN)/iclab list --markdown --update README.md

clean:
	rm -rf $(VENV) iclab-results .pytest_cache test-artifacts site build
