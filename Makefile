# Tessel: `make run` trains configs/default.yaml; `make check` runs the fast tier (after every
# edit, under 3 minutes); `make test` runs every test. They install what is missing first
# (third_party/setup.sh; seconds when everything is there). docs/building.md describes the tiers.
SHELL := /bin/bash
BUILD ?= build
JOBS ?= $(shell nproc)
CACHE := $(or $(TESSEL_CACHE),$(HOME)/.cache/tessel)

# ccache shared by every checkout of this user: paths are made relative to the checkout, so a fresh
# clone hits the cache. The PCH needs the two sloppiness flags to be cacheable.
export CCACHE_DIR ?= $(CACHE)/ccache
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := true
export CCACHE_SLOPPINESS := pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_MAXSIZE ?= 5G
# cmake and ninja from PyPI (setup.sh puts them there only when the machine has none): last on PATH.
export PATH := $(PATH):$(CURDIR)/.env/bin

.PHONY: setup setup-test configure build run check test test-no-toolkit test-aarch64 test-old-distro docs bundle \
	bundle-portable clean
setup:
	@third_party/setup.sh build
setup-test:
	@third_party/setup.sh test

configure:
	@[ -f $(BUILD)/build.ninja ] || cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release | grep -v "^--" || true

build: setup configure
	@cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/bin/tessel-train configs/default.yaml $(ARGS)

# Two entries at a time where both fit (each entry's PROCESSORS: multi-rank entries run alone);
# the time per label and the ten slowest entries at the end (tools/ctest_times.py).
CTEST_JOBS ?= 2
check: setup-test configure
	@cmake --build $(BUILD) -j $(JOBS)
	@cd $(BUILD) && ctest --output-on-failure -j $(CTEST_JOBS) -L '^check$$' --output-junit ctest-junit.xml $(CTEST_ARGS); \
	  rc=$$?; $(CURDIR)/.env/bin/python $(CURDIR)/tools/ctest_times.py . 5 || true; exit $$rc

test: setup-test configure
	@cmake --build $(BUILD) -j $(JOBS)
	@cd $(BUILD) && ctest --output-on-failure -j $(CTEST_JOBS) --output-junit ctest-junit.xml $(CTEST_ARGS); \
	  rc=$$?; $(CURDIR)/.env/bin/python $(CURDIR)/tools/ctest_times.py . 10 || true; exit $$rc

# The build on a machine without a CUDA toolkit (hidden in a mount namespace): configure, build
# tessel-train, train 5 steps (docs/building.md gives its time).
test-no-toolkit: setup
	@tests/install/no_toolkit.sh $(CURDIR) --build

# The aarch64 (Grace) build: cross-compiled, then the unit tests and 10 steps of
# configs/default.yaml under qemu-user against this build's losses (docs/building.md gives its time).
test-aarch64: build
	@tests/cross/aarch64_train.sh $(CURDIR)/$(BUILD)/bin $(CURDIR)/$(BUILD)/aarch64

# A relocatable install packed as one archive (docs/gpu.md): runs against any python's torch
# 2.11, with no root, no apt, no network. build/tessel-<commit>-<arch>.tar.gz.
bundle: build
	@rm -rf $(BUILD)/bundle && cmake --install $(BUILD) --prefix $(BUILD)/bundle/tessel >/dev/null
	@name=tessel-$$(git rev-parse --short HEAD)-$$(uname -m); \
	  tar -C $(BUILD)/bundle -czf $(BUILD)/$$name.tar.gz tessel && \
	  echo "$(BUILD)/$$name.tar.gz ($$(du -h $(BUILD)/$$name.tar.gz | cut -f1))"

# The bundle for the systems clusters run (glibc 2.28 and newer: RHEL/Rocky 8 and 9, Ubuntu
# 20.04-24.04), built inside a Debian 11 root (tools/portable/bundle.sh; needs root and
# debootstrap): build/tessel-<commit>-<arch>-glibc<floor>.tar.gz. ARCH=aarch64: the Grace bundle,
# with the root's cross compiler.
bundle-portable: build
	@tools/portable/bundle.sh $(CURDIR) $(or $(ARCH),x86_64)

# Those bundles run by a user without root in Debian 11 and Ubuntu 22.04 roots, the aarch64 one
# under qemu (docs/building.md gives its time).
test-old-distro: build
	@tests/install/old_distro.sh

# docs/configuration.md is generated from the field declarations (a test checks it is current).
docs: build
	$(BUILD)/bin/tessel-train --help-config > docs/configuration.md

clean:
	rm -rf $(BUILD)
