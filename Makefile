# Thin wrappers around the scripts in bin/ and .ci/.
.PHONY: run check test lint docs ci

run: ## serve the site on http://127.0.0.1:8000 (SQLite, Celery worker); installs requirements/run.txt only
	bin/run

check: ## smoke test the main job: migrate, admin login, GET /admin/login/
	bin/run --check

test: ## the whole suite: ruff, mypy, pytest on PostgreSQL, SQLite and the LTS leg; installs missing Debian packages (root or sudo) or says which
	bin/test

lint: ## ruff, mypy and the docs build (no pytest)
	COORDINATION_TEST_LEGS= bin/test

docs: ## build the documentation site into site/ (MkDocs, warnings as errors); installs requirements/docs.txt into .venv-docs
	bin/docs

ci: ## what CI runs: bin/test, then bin/run --check
	.ci/run
