# syntax=docker/dockerfile:1
# aiprobe agent image: docker build -t aiprobe:0.1.0 .   (deploy/kubernetes runs it as a DaemonSet)
#
# Build stage: the BPF objects are compiled by the README's own targets (`make bpf`), with the
# compiler part of the Makefile's APT_PACKAGES. vmlinux.h comes from the build host's BTF
# (/sys/kernel/btf/vmlinux); CO-RE makes the objects run on any kernel with BTF.
ARG DEBIAN=bookworm
FROM debian:${DEBIAN} AS build
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY Makefile pyproject.toml README.md ./
COPY bpf/ bpf/
COPY agent/ agent/
COPY exporters/ exporters/
RUN make bpf APT_PACKAGES="clang llvm libbpf-dev make python3-venv"
# The package, with the objects just built as its package data, into a venv copied whole below.
RUN python3 -m venv /opt/aiprobe && /opt/aiprobe/bin/pip install --no-cache-dir . \
    && test -n "$(ls /opt/aiprobe/lib/python3*/site-packages/aiprobe/bpf_objects/*.bpf.o)"

# Runtime stage: Python, the package and libbpf1 only — no compiler, LLVM or kernel headers.
FROM debian:${DEBIAN}-slim
RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 libbpf1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/aiprobe /opt/aiprobe
COPY deploy/aiprobe.toml /etc/aiprobe/aiprobe.toml
ENV PATH=/opt/aiprobe/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
EXPOSE 9645
ENTRYPOINT ["aiprobe"]
CMD ["agent", "--config", "/etc/aiprobe/aiprobe.toml"]
