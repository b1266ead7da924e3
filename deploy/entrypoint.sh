#!/usr/bin/env bash
# The image's entrypoint: read each secret named by a *_FILE variable into its variable, then run
# the command. Docker and compose give secrets as files; cs3ray reads CS3_SERVE_TOKEN from the
# environment. (Kubernetes runs its own command and gives secrets as env vars: this is skipped.)
set -euo pipefail
for name in CS3_SERVE_TOKEN; do
  file_var="${name}_FILE"
  if [[ -n "${!file_var:-}" && -z "${!name:-}" ]]; then
    if [[ ! -r "${!file_var}" ]]; then
      echo "error: $file_var names ${!file_var}, which cannot be read." >&2
      exit 2
    fi
    export "$name=$(<"${!file_var}")"  # $(<...) drops the trailing newline
  fi
  unset "$file_var"
done
exec "$@"
