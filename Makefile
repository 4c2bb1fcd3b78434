# Tessel: `make run` trains configs/default.yaml; `make test` runs every test. Both install what is
# missing first (third_party/setup.sh; seconds when everything is there).
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

.PHONY: setup setup-test configure build run test docs clean
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

test: setup-test configure
	@cmake --build $(BUILD) -j $(JOBS)
	@cd $(BUILD) && ctest --output-on-failure -j 1 $(CTEST_ARGS)

# docs/configuration.md is generated from the field declarations (a test checks it is current).
docs: build
	$(BUILD)/bin/tessel-train --help-config > docs/configuration.md

clean:
	rm -rf $(BUILD)
