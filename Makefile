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

# openssh-server, rsync, procps (pkill) and chromium for the SSH and browser tests, where missing.
system-deps:
	@missing=""; \
	[ -x /usr/sbin/sshd ] || missing="$$missing openssh-server"; \
	command -v rsync >/dev/null || missing="$$missing rsync"; \
	command -v ssh >/dev/null || missing="$$missing openssh-client"; \
	command -v pkill >/dev/null || missing="$$missing procps"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

DEMO := .fabtrain/demo
DASHBOARD_PORT ?= 8265

# The whole mission on this machine: sample data, check, deploy, copy each
# trainer's shard, start the pserver and trainers, and the dashboard.
demo: venv
	@command -v rsync >/dev/null || $(MAKE) --no-print-directory system-deps
	@mkdir -p $(DEMO) && chmod 700 $(DEMO)
	@$(MAKE) --no-print-directory stop
	$(FAB) split-data check deploy copy-data start-pserver start-trainers
	@[ -s $(DEMO)/token ] || $(PY) -c 'import secrets; print(secrets.token_hex(24))' > $(DEMO)/token
	@FABTRAIN_DASHBOARD_TOKEN=$$(cat $(DEMO)/token) nohup $(FAB) dashboard --port $(DASHBOARD_PORT) \
	    > $(DEMO)/dashboard.log 2>&1 < /dev/null & echo $$! > $(DEMO)/dashboard.pid
	@for i in $$(seq 50); do grep -q "http://" $(DEMO)/dashboard.log 2>/dev/null && break; sleep 0.2; done
	@grep -q "http://" $(DEMO)/dashboard.log || { cat $(DEMO)/dashboard.log; exit 1; }
	@echo
	@echo "Training has started: 1 parameter server and 2 trainers on this machine."
	@echo "  dashboard:  http://127.0.0.1:$(DASHBOARD_PORT)/?token=$$(cat $(DEMO)/token)"
	@echo "  status:     $(FAB) status"
	@echo "  logs:       $(FAB) logs --follow"
	@echo "  progress:   $(FAB) watch"
	@echo "  stop:       $(FAB) kill-all     (make stop also stops the dashboard)"

# Stop the demo: every job process, then the dashboard.
stop: venv
	$(FAB) kill-all
	@if [ -s $(DEMO)/dashboard.pid ]; then \
	  pid=$$(cat $(DEMO)/dashboard.pid); kill $$pid 2>/dev/null || true; \
	  for i in $$(seq 50); do kill -0 $$pid 2>/dev/null || break; sleep 0.1; done; \
	  kill -9 $$pid 2>/dev/null || true; rm -f $(DEMO)/dashboard.pid; fi

test: venv system-deps
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
