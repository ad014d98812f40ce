# aiprobe — every target sets up what it needs and is safe to run again.
#   make run    install deps, build, run `aiprobe top` on this host (interactive: processes, flows, GPUs, alerts)
#   make test   install deps, build, run ruff and the whole test suite (as root)
#   make bench  install deps, build, run benchmarks/ and print a table of ratios
#   make test-kernels  the `kernels` tests on Debian 11's and 12's stock kernels booted in qemu, and on this host
#                      (MATRIX_ARGS="--repeat 5" runs each selection 5 times in one boot, to find flakes)

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMPS := .make
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

# Build and test dependencies from Debian/Ubuntu. Nodes that only run aiprobe need libbpf1 alone.
APT_PACKAGES := clang llvm libbpf-dev iproute2 make gcc libc6-dev python3-venv python3-pip \
                tmux prometheus prometheus-alertmanager ruby wrk ethtool iperf3 nginx
# bpftool is its own package on Debian (and recent Ubuntu); older Ubuntu ships it in linux-tools
# (the deps recipe falls back to those).

# make test-kernels: qemu and what virtme-ng's guest init needs; virtme-ng itself in its own venv.
KERNEL_APT_PACKAGES := qemu-system-x86 busybox-static kmod file
VNG_VENV := build/kernels/vng-venv

.PHONY: run test bench setup deps venv bpf vmlinux lint clean test-kernels

run: setup
	$(SUDO) $(BIN)/aiprobe top

test: setup lint
	$(BIN)/pytest -ra $(PYTEST_ARGS)

bench: setup
	$(BIN)/python -m benchmarks

test-kernels: setup $(STAMPS)/kernel-deps
	$(BIN)/python tests/kernels/matrix.py $(MATRIX_ARGS)

$(STAMPS)/kernel-deps: Makefile $(STAMPS)/deps
	@dpkg-query -W -f='$${Status}\n' $(KERNEL_APT_PACKAGES) 2>/dev/null | grep -c 'install ok installed' \
	  | grep -qx '$(words $(KERNEL_APT_PACKAGES))' || \
	  { $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends $(KERNEL_APT_PACKAGES); }
	[ -x $(VNG_VENV)/bin/vng ] || { $(PYTHON) -m venv $(VNG_VENV) && $(VNG_VENV)/bin/pip install -q virtme-ng==1.42; }
	@touch $@

lint: venv
	$(BIN)/ruff check agent exporters tests benchmarks
	@rm -rf $(STAMPS)/typecheck && mkdir -p $(STAMPS)/typecheck/aiprobe
	@ln -s $(CURDIR)/agent/* $(STAMPS)/typecheck/aiprobe/ && ln -s $(CURDIR)/exporters $(STAMPS)/typecheck/aiprobe/
	cd $(STAMPS)/typecheck && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p aiprobe

setup: deps venv bpf

deps: $(STAMPS)/deps
$(STAMPS)/deps: Makefile
	@mkdir -p $(STAMPS)
	@n=$$(dpkg-query -W -f='$${Status}\n' $(APT_PACKAGES) 2>/dev/null | grep -c 'install ok installed'); \
	if [ "$$n" = "$(words $(APT_PACKAGES))" ] && command -v bpftool >/dev/null; then \
	  echo "apt packages: all installed"; \
	else \
	  install="$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends"; \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	  $$install $(APT_PACKAGES) && \
	  { command -v bpftool >/dev/null || $$install bpftool 2>/dev/null || \
	    $$install linux-tools-common linux-tools-$$(uname -r); }; \
	fi
	@touch $@

venv: $(STAMPS)/venv
$(STAMPS)/venv: pyproject.toml $(STAMPS)/deps
	@mkdir -p $(STAMPS)
	[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	@touch $@

# CO-RE objects: compiled once here, shipped inside the package (agent/bpf_objects/).
bpf: deps
	$(MAKE) -C bpf

# Regenerate bpf/.output/vmlinux.h from this kernel's BTF (see bpf/README.md).
vmlinux: deps
	$(MAKE) -C bpf vmlinux

clean:
	$(MAKE) -C bpf clean
	rm -rf $(STAMPS) tests/fixtures/build
