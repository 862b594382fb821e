#!/usr/bin/env bash
# Reproduce what Binder (repo2docker) does with binder/, without Docker, and time it.
#
# repo2docker reads binder/runtime.txt (Python 3.11), makes a conda env holding Jupyter
# (jupyterlab 4, notebook 7, jupyter_server 2, ipywidgets 8), copies the repository, runs
# `pip install --no-cache-dir -r binder/requirements.txt` from the repository root, then
# `./binder/postBuild`, and starts `jupyter notebook`. Here: a fresh clone of the committed tree
# (what Binder sees), a fresh virtualenv and an empty HOME (no model or pip caches), the same
# steps in the same order; then the time to a ready kernel (server answering, a kernel started,
# `%load_ext metaclaw` run) and every notebook executed with no API key in the environment, its
# outputs checked for errors and tracebacks.
# `repo2docker --no-build --debug .` prints the Dockerfile these steps follow.
#
#     bash benchmarks/binder_ready.sh [WORKDIR]        (python3.11 on PATH; a few minutes)
# Where PyTorch's CPU index cannot be reached, pip would take PyPI's CUDA torch (several GB): set
# PIP_CONSTRAINT to a file holding `torch==2.13.0` (a CPU wheel where the index serves one).
# With an existing WORKDIR/env (a previous run) the build steps are skipped and only the start-up
# and the notebooks are measured again.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-$(mktemp -d /tmp/binder-ready.XXXXXX)}"
export HOME="$WORK/home" PIP_NO_CACHE_DIR=1 HF_HUB_OFFLINE=1
mkdir -p "$HOME"
unset OPENAI_API_KEY METACLAW_UPSTREAM_API_KEY METACLAW_EVOLVER_API_KEY ANTHROPIC_API_KEY || true
now() { date +%s.%N; }
took() { python3 -c "print(f'{$(now) - $1:.1f}')"; }

if [ -d "$WORK/env" ]; then
  cd "$WORK/repo"; . "$WORK/env/bin/activate"; echo "reusing the environment in $WORK/env"
else
  git clone -q "$REPO" "$WORK/repo"
  cd "$WORK/repo"
  git -C "$REPO" diff --quiet HEAD || echo "note: uncommitted changes in $REPO are not checked"
  PY="python$(sed -n 's/^python-\([0-9.]*\).*/\1/p' binder/runtime.txt)"
  t=$(now); "$PY" -m venv "$WORK/env"; . "$WORK/env/bin/activate"
  # the notebook environment's Jupyter packages at the versions of repo2docker's lock (see
  # docs/how-to/binder.md), so the kernel is the one Binder runs
  pip install -q jupyterlab==4.4.9 notebook==7.4.7 jupyter_server==2.17.0 ipykernel==7.0.1 \
    ipywidgets==8.1.7 jupyterlab_widgets==3.0.15 widgetsnbextension==4.0.14
  echo "jupyter base env: $(took "$t") s"
  t=$(now); pip install -q -r binder/requirements.txt
  echo "pip install -r binder/requirements.txt: $(took "$t") s"
  t=$(now); chmod +x binder/postBuild; ./binder/postBuild; echo "binder/postBuild: $(took "$t") s"
fi
# Binder runs as an unprivileged user; a root shell (a CI container) needs --allow-root
ROOT_FLAG=""; [ "$(id -u)" = 0 ] && ROOT_FLAG="--allow-root"

PORT=$(python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
t=$(now)
jupyter notebook --no-browser --ip 127.0.0.1 --port "$PORT" --IdentityProvider.token='' --ServerApp.disable_check_xsrf=True $ROOT_FLAG \
  > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/api/status" > /dev/null && break
  kill -0 $SERVER 2>/dev/null || { tail -5 "$WORK/server.log"; exit 1; }
  sleep 0.2
done
echo "jupyter server answering: $(took "$t") s"
python - "$PORT" <<'PY'
import json, sys, time, urllib.request
from jupyter_client.blocking import BlockingKernelClient

port = sys.argv[1]
start = time.time()
req = urllib.request.Request(f"http://127.0.0.1:{port}/api/kernels", data=b"{}", method="POST",
                             headers={"Content-Type": "application/json"})
kernel = json.load(urllib.request.urlopen(req))
import jupyter_core.paths, os
conn = os.path.join(jupyter_core.paths.jupyter_runtime_dir(), f"kernel-{kernel['id']}.json")
while not os.path.exists(conn):
    time.sleep(0.05)
client = BlockingKernelClient(connection_file=conn)
client.load_connection_file()
client.start_channels()
client.wait_for_ready(timeout=120)
ready = time.time() - start
reply = client.execute_interactive("%load_ext metaclaw\nimport metaclaw; print(metaclaw.__file__)",
                                   timeout=120)
assert reply["content"]["status"] == "ok", reply
print(f"kernel ready: {ready:.1f} s; %load_ext metaclaw done: {time.time() - start:.1f} s "
      "after the kernel request")
client.stop_channels()
PY
echo "time to a ready kernel with metaclaw loaded (server start -> first cell done): $(took "$t") s"
kill $SERVER; trap - EXIT

# every tutorial run whole in that environment, no API key; an error or a traceback printed on
# stderr (a widget update lost in a thread, say) fails it, as it would show in a student's cell
python -m pip install -q nbconvert
mkdir -p "$WORK/executed"
t=$(now)
for nb in notebooks/*.ipynb; do
  jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=600 \
    --output-dir "$WORK/executed" "$nb" 2> "$WORK/nbconvert.log" ||
    { tail -20 "$WORK/nbconvert.log"; exit 1; }
done
python - "$WORK/executed" <<'PY'
import json, pathlib, sys

bad = []
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.ipynb")):
    for i, cell in enumerate(json.loads(path.read_text())["cells"]):
        for out in cell.get("outputs", []):
            text = "".join(out.get("text", "")) if out.get("name") == "stderr" else ""
            if out.get("output_type") == "error" or "Traceback" in text:
                bad.append(f"{path.name} cell {i}: {(text or out.get('ename', ''))[:200]}")
print("\n".join(bad) or "no error and no traceback in any output")
sys.exit(1 if bad else 0)
PY
echo "every notebook executed, no API key: $(took "$t") s"
