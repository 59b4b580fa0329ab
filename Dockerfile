# nlp_tricks on NVIDIA GPUs: the package, its recipes and launch configs, with `accelerate launch` as entrypoint.
#
#   docker build -t nlp-tricks .
#   docker run --gpus all --rm -v "$PWD/data:/data" -v "$PWD/outputs:/outputs" nlp-tricks \
#       --config_file accelerate_configs/multi_gpu_fp16.yaml recipes/ner.py --output_dir /outputs/ner
#
# Needs the NVIDIA container toolkit on the host (see README, "Running in Docker").
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128

# ---- build: a virtual environment with torch (CUDA), the package and its extras ----
FROM ${CUDA_IMAGE} AS build
ARG TORCH_INDEX
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install torch --index-url ${TORCH_INDEX}
WORKDIR /src
COPY pyproject.toml README.md ./
COPY nlp_tricks ./nlp_tricks
RUN pip install ".[demo,plot]"

# ---- final: the CUDA runtime, Python and the environment; no compilers ----
FROM ${CUDA_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH HF_HOME=/cache/huggingface PYTHONUNBUFFERED=1
WORKDIR /workspace
COPY recipes ./recipes
COPY accelerate_configs ./accelerate_configs
COPY scripts ./scripts
VOLUME ["/data", "/outputs", "/cache"]
ENTRYPOINT ["accelerate", "launch"]
CMD ["--config_file", "accelerate_configs/single_gpu.yaml", "recipes/ner.py", "--output_dir", "/outputs/ner"]
