#!/bin/sh
# pip install inside an image build, with the build host's pip settings and CA bundle when given (make
# images passes them as build args and a build secret, never as files of an image). Copied into build
# stages only; no final image carries it.
set -eu
for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST; do
  eval "value=\${$var:-}"
  if [ -z "$value" ]; then unset "$var"; else export "$var"; fi
done
if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi
exec pip install --disable-pip-version-check "$@"
