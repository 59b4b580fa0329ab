# nlp_tricks on NVIDIA GPUs: the package with its extras, the recipes, launch configs, GPU tests and benchmarks, with
# `accelerate launch` as the entrypoint (arguments after the image name are accelerate launch's).
#
#   docker build -t nlp-tricks .
#   docker run --gpus all --rm --ipc=host -v "$PWD/data:/data:ro" -v "$PWD/outputs:/outputs" nlp-tricks \
#       --config_file accelerate_configs/multi_gpu_fp16.yaml --num_processes 2 recipes/ner.py \
#       --train_file /data/train.conll --validation_file /data/dev.conll --output_dir /outputs/ner
#   docker run --gpus all --rm --entrypoint bash nlp-tricks scripts/gpu_check.sh
#
# Needs the NVIDIA container toolkit on the host (docs/gpu.md, "Running in Docker"). Two stages: the first builds a
# virtual environment (with compilers, for any source distribution); the second holds only the CUDA runtime, Python and
# that environment.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
# The PyTorch wheel index of a CUDA version the base image and the host's driver support (cu128: driver >= 570, or an
# older driver through CUDA's minor-version compatibility).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

# ---- build: a virtual environment with torch (CUDA), the package and its extras ----
FROM ${CUDA_IMAGE} AS build
ARG TORCH_INDEX
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install torch --index-url ${TORCH_INDEX} \
    && python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 'torch was installed without CUDA')"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY nlp_tricks ./nlp_tricks
# Non-editable: the package lands in the environment, and /src stays behind in this stage.
RUN pip install ".[demo,plot,test]" \
    && python -c "import torch, sys; sys.exit(0 if torch.version.cuda else 'a CPU torch replaced the CUDA one')"

# ---- final: the CUDA runtime, Python and the environment; no compilers, no headers ----
FROM ${CUDA_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 ca-certificates \
    && rm -rf /var/lib/apt/lists/*
# The environment's python is a link to /usr/bin/python3, which this stage installs from the same base image.
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH HF_HOME=/cache/huggingface PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
WORKDIR /workspace
COPY pyproject.toml ./
COPY recipes ./recipes
COPY accelerate_configs ./accelerate_configs
COPY scripts ./scripts
COPY tests ./tests
COPY benchmarks ./benchmarks
VOLUME ["/data", "/outputs", "/cache"]
ENTRYPOINT ["accelerate", "launch"]
CMD ["--config_file", "accelerate_configs/single_gpu.yaml", "recipes/ner.py", "--output_dir", "/outputs/ner"]
