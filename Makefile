# rollwave — every target is documented in README.md.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PIP     := $(BIN)/pip -q --disable-pip-version-check
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
# Where pip finds torch (empty: pip's own index). Set it where that index offers only the CUDA build, e.g.
# make install TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=

# Debian/Ubuntu packages as command:package; a package is installed only when its command is missing.
VENV_PACKAGES   = $(shell $(PY) -c 'import ensurepip' 2>/dev/null || echo ensurepip:python3-venv)
TEST_PACKAGES  := prometheus:prometheus promtool:prometheus chromium:chromium ip:iproute2 unshare:util-linux bwrap:bubblewrap \
                  openssl:openssl
DEPLOY_PACKAGES := dockerd:docker.io docker-compose:docker-compose debootstrap:debootstrap
DEMO_PACKAGES  := unshare:util-linux bwrap:bubblewrap
BENCH_PACKAGES := redis-benchmark:redis-tools

.PHONY: install demo test test-cuda test-deploy stress lint proto bench clean

# $(call system_packages,COMMAND:PACKAGE ...): apt-get install, as root or else through sudo, the packages
# whose command is not on PATH, without letting Debian start their daemons (a policy-rc.d that refuses, for
# the length of the install, unless one is already there). Where that cannot be done it stops and prints
# the command to run as root.
define system_packages
	@PATH="$$PATH:/usr/sbin:/sbin"; missing=; \
	for want in $(1); do \
	  command -v "$${want%%:*}" >/dev/null 2>&1 || case " $$missing " in \
	    *" $${want#*:} "*) ;; *) missing="$$missing $${want#*:}" ;; esac; \
	done; \
	[ -z "$$missing" ] && exit 0; \
	cmd="apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends$$missing"; \
	if [ "$$(id -u)" = 0 ]; then as=; elif command -v sudo >/dev/null 2>&1; then as=sudo; else as=none; fi; \
	if ! command -v apt-get >/dev/null 2>&1 || [ "$$as" = none ]; then \
	  echo "make: missing system packages:$$missing. Run as root:" >&2; echo "  $$cmd" >&2; exit 1; \
	fi; \
	echo "make: installing$$missing with apt-get$${as:+ through sudo}"; \
	guard=/usr/sbin/policy-rc.d; script="$$cmd >/dev/null"; \
	[ -e $$guard ] || script="trap 'rm -f $$guard' EXIT; printf '#!/bin/sh\nexit 101\n' >$$guard; \
	  chmod 755 $$guard; $$script"; \
	$$as sh -c "$$script" || { echo "make: apt-get failed. Run as root:" >&2; echo "  $$cmd" >&2; exit 1; }
endef

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	$(call system_packages,$(VENV_PACKAGES))
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	$(PIP) install -c constraints.txt $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) torch==2.13.0
	$(PIP) install -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: install
	$(call system_packages,$(DEMO_PACKAGES))
	$(BIN)/python -m services.demo $(DEMO_ARGS)

# Three workers: one runs the end-to-end tests (marker slow: tests/conftest.py makes them one xdist group, first) one
# at a time, never two stacks at once, while the others share the rest, and then all three.
test: install
	$(call system_packages,$(TEST_PACKAGES))
	$(BIN)/python -m pytest -x -q -n 3 --dist loadgroup -m "not cuda"

# The tests that need a GPU (marker cuda; the CPU tests above leave them out), on a host where torch sees one.
test-cuda: install
	$(PIP) install -c constraints.txt 'torch-memory-saver>=0.0.10'
	$(BIN)/python -m pytest -q -s -m cuda

# The compose deployment for real: builds the CPU image and runs the stack on this host (tests/deploy/run.py).
test-deploy: install
	$(call system_packages,$(DEPLOY_PACKAGES))
	$(BIN)/python tests/deploy/run.py

stress: install
	$(call system_packages,$(TEST_PACKAGES))
	tests/stress.sh

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

proto: install
	$(BIN)/python -m proto.generate

bench: install
	$(call system_packages,$(BENCH_PACKAGES))
	for b in bench/*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info .deploy-test
