# Two commands: `make demo` runs the main job here; `make test` runs every test.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
FAB := $(VENV)/bin/fab

.PHONY: demo test venv system-deps stop wait-dashboard

# torch==2.13.0 is a CPU build only where pip finds a CPU wheel (a local wheel
# directory or index); from PyPI alone, Linux gets the multi-GB CUDA build. Elsewhere:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (passed to pip as --extra-index-url: torch comes as 2.13.0+cpu, the rest from PyPI).
TORCH_INDEX ?=

$(VENV)/.installed: requirements-test.txt pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) -r requirements-test.txt
	@$(PY) -c 'import torch, sys; torch.version.cuda and print(f"note: torch {torch.__version__} is a CUDA build; for the CPU build: rm -rf $(VENV) && make test TORCH_INDEX=https://download.pytorch.org/whl/cpu", file=sys.stderr)'
	touch $@

venv: $(VENV)/.installed

# What the tests need that is not in the venv, where missing: openssh-server and
# openssh-client (sshd nodes), rsync, procps (pkill), chromium at /usr/bin/chromium
# (the path the browser test drives), iproute2 (ip, for the network-namespace tests), nftables
# (nft: the partition tests' cuts),
# openmpi-bin with libopenmpi-dev (mpirun, and mpicc for the MPI tests' program) and
# slurm-wlm with munge (the Slurm tests' cluster: slurmctld, slurmd, munged), and
# kubernetes-client (kubectl, for fab status/logs/kill-all on pods; the tests use a stand-in).
system-deps:
	@missing=""; \
	[ -x /usr/sbin/sshd ] || missing="$$missing openssh-server"; \
	command -v rsync >/dev/null || missing="$$missing rsync"; \
	command -v ssh >/dev/null || missing="$$missing openssh-client"; \
	command -v pkill >/dev/null || missing="$$missing procps"; \
	[ -x /usr/bin/chromium ] || missing="$$missing chromium"; \
	command -v ip >/dev/null || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || missing="$$missing iproute2"; \
	command -v nft >/dev/null || [ -x /usr/sbin/nft ] || missing="$$missing nftables"; \
	command -v mpirun >/dev/null || [ -x /usr/bin/mpirun ] || missing="$$missing openmpi-bin"; \
	command -v mpicc >/dev/null || [ -x /usr/bin/mpicc ] || missing="$$missing libopenmpi-dev"; \
	command -v cc >/dev/null || [ -x /usr/bin/cc ] || missing="$$missing gcc"; \
	command -v slurmctld >/dev/null || [ -x /usr/sbin/slurmctld ] || missing="$$missing slurm-wlm"; \
	command -v munged >/dev/null || [ -x /usr/sbin/munged ] || missing="$$missing munge"; \
	command -v kubectl >/dev/null || [ -x /usr/bin/kubectl ] || missing="$$missing kubernetes-client"; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	fi

DEMO := .fabtrain/demo
DASHBOARD_PORT ?= 8265
DASHBOARD_WAIT ?= 120
# Answers 0 once the dashboard serves its API with our token (any other server, or none: non-zero).
DASHBOARD_PROBE := import sys, urllib.request as u; u.urlopen(u.Request(sys.argv[1], headers={"Authorization": "Bearer " + sys.argv[2]}), timeout=5)

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
	@$(MAKE) --no-print-directory wait-dashboard
	@echo
	@echo "Training has started: 1 parameter server and 2 trainers on this machine."
	@echo "  dashboard:  http://127.0.0.1:$(DASHBOARD_PORT)/?token=$$(cat $(DEMO)/token)"
	@echo "  status:     $(FAB) status"
	@echo "  logs:       $(FAB) logs --follow"
	@echo "  progress:   $(FAB) watch"
	@echo "  stop:       $(FAB) kill-all     (make stop also stops the dashboard)"

# Wait for the dashboard started by `demo` until it answers its API with the token
# (up to DASHBOARD_WAIT s: on a busy machine starting it can take a while). If its
# process ends first, or it does not answer in time, say so, show its log and fail.
wait-dashboard:
	@pid=$$(cat $(DEMO)/dashboard.pid); token=$$(cat $(DEMO)/token); start=$$SECONDS; \
	url=http://127.0.0.1:$(DASHBOARD_PORT)/api/job; \
	alive() { [ -r /proc/$$pid/stat ] && [ "$$(sed 's/.*) //' /proc/$$pid/stat | cut -c1)" != Z ]; }; \
	while :; do \
	  if ! alive; then \
	    echo "make demo: the dashboard (pid $$pid) exited before it answered on $$url; its log ($(DEMO)/dashboard.log):" >&2; \
	    cat $(DEMO)/dashboard.log >&2; exit 1; \
	  fi; \
	  if grep -q "http://" $(DEMO)/dashboard.log 2>/dev/null && $(PY) -c '$(DASHBOARD_PROBE)' $$url $$token 2>/dev/null; then \
	    exit 0; \
	  fi; \
	  if [ $$((SECONDS - start)) -ge $(DASHBOARD_WAIT) ]; then \
	    echo "make demo: the dashboard (pid $$pid) did not answer on $$url within $(DASHBOARD_WAIT) s; stopping it. Its log ($(DEMO)/dashboard.log):" >&2; \
	    cat $(DEMO)/dashboard.log >&2; kill $$pid 2>/dev/null; rm -f $(DEMO)/dashboard.pid; exit 1; \
	  fi; \
	  sleep 0.5; \
	done

# Stop the demo: every job process, then the dashboard.
stop: venv
	$(FAB) kill-all
	@if [ -s $(DEMO)/dashboard.pid ]; then \
	  pid=$$(cat $(DEMO)/dashboard.pid); kill $$pid 2>/dev/null || true; \
	  for i in $$(seq 50); do kill -0 $$pid 2>/dev/null || break; sleep 0.1; done; \
	  kill -9 $$pid 2>/dev/null || true; rm -f $(DEMO)/dashboard.pid; fi

# `make test` installs the apt packages and the venv at once (apt unpacks .debs while pip unpacks wheels).
# The unit tests start no daemon and time nothing, but some wait (an election's rounds, a webhook's
# timeout): they run on two workers a core (pytest-xdist; on 2 cores 83 s against 101 s on two workers),
# each file's tests on one worker in their order (a module's fixture may be shared by its tests). The rest start
# sshd, Slurm, mpirun and browsers, and wait on them: three files run at once, each on one worker in its
# order. On a 2-core machine two workers left 28 % of the CPU idle (22.8 minutes), three 13-19 % (16.8-18.7
# minutes); four left 10 % and took 17.7 minutes in a fresh clone: at three the phase is bound by its
# CPU-seconds (1,964 measured), so a fourth worker only makes each test slower. Every test draws its own ports, folders, daemons and, in
# tests/support/netns.py, addresses. Those marked `alone` hold the whole machine on purpose (every core, 200
# nodes) and run last, by themselves. PYTEST_ARGS go to both of those runs (a file or -k there);
# pytest's exit code 5 (nothing selected) is not a failure. Each run ends with its slowest tests
# (--durations), so a run that grows says where. The tests run with Python's bytecode caches, as a
# user's install has them: an image that sets PYTHONDONTWRITEBYTECODE would have every one of the
# suite's thousands of fab, node-ops, agent and launcher processes compile its modules.
PYTEST = env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -p no:cacheprovider
UNIT_WORKERS := $(shell echo $$(( 2 * $$(nproc 2>/dev/null || echo 1) )))
test:
	@$(MAKE) --no-print-directory -j2 system-deps venv
	$(PYTEST) -n $(UNIT_WORKERS) --dist loadfile --durations=10 tests/unit
	$(PYTEST) -n 3 --dist loadfile --durations=25 -m "not alone" --ignore=tests/unit $(PYTEST_ARGS) || [ $$? = 5 ]
	$(PYTEST) --durations=5 -m alone --ignore=tests/unit $(PYTEST_ARGS) || [ $$? = 5 ]
