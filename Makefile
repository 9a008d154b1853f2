# Two commands: `make demo` runs the main job here; `make test` runs every test.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
FAB := $(VENV)/bin/fab

.PHONY: demo test venv system-deps stop

$(VENV)/.installed: requirements-test.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-test.txt
	touch $@

venv: $(VENV)/.installed

# openssh-server, rsync and chromium for the SSH and browser tests, where missing.
system-deps:
	@missing=""; \
	[ -x /usr/sbin/sshd ] || missing="$$missing openssh-server"; \
	command -v rsync >/dev/null || missing="$$missing rsync"; \
	command -v ssh >/dev/null || missing="$$missing openssh-client"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

demo: venv
	@command -v rsync >/dev/null || $(MAKE) system-deps
	$(PY) -m orchestrator.demo

stop: venv
	$(FAB) kill-all

test: venv system-deps
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
