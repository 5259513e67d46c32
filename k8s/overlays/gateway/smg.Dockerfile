# The smg image of the gateway overlay: the smg wheel from PyPI (a Rust binary in a manylinux
# wheel that needs only glibc) on a slim Python base. Build and push it yourself:
#   docker build -f k8s/overlays/gateway/smg.Dockerfile -t registry.example.com/smg:1.13.0 .
# Keep the version here and the image tag in smg/kustomization.yaml the same (a test checks).
FROM python:3.12-slim-bookworm

ARG SMG_VERSION=1.13.0
RUN pip install --no-cache-dir "smg==${SMG_VERSION}" \
    && python3 -c "from smg import smg_rs" \
    && useradd --system --no-log-init --uid 65532 smg

# Numeric, so runAsNonRoot can verify it; the Deployment's runAsUser is the same.
USER 65532
EXPOSE 8080 8081 29000
ENTRYPOINT ["python3", "-m", "smg.launch_router"]
