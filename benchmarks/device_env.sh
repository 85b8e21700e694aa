# Source this on a GPU machine that has torch/triton but cannot pip-install the package (no network,
# no editable install): it lays the package out as setup.py's package_dir does (setup.py run with setup()
# recording its arguments: kernels/core/ is megassm/kernels, kernels/norm/ megassm/kernels/norm, ...), in /tmp/site, copies
# the tests/configs/benchmarks to /tmp/w and cd's there, so `pytest -m gpu` and the benchmarks import
# the megassm of this checkout. DEVICE_SITE / DEVICE_WORK name other folders, for two checkouts side by side.
export PYTHONUNBUFFERED=1
_src=$(pwd)
_site=${DEVICE_SITE:-/tmp/site}
_work=${DEVICE_WORK:-/tmp/w}
rm -rf "$_site" "$_work" && mkdir -p "$_site" "$_work"
python - "$_src" "$_site" <<'PY'
import os, runpy, shutil, sys
import setuptools
src, site = sys.argv[1:]
seen = {}
setuptools.setup = lambda **kw: seen.update(kw)
runpy.run_path(os.path.join(src, "setup.py"))
for package, folder in seen["package_dir"].items():
    dest = os.path.join(site, *package.split("."))
    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(os.path.join(src, folder)):
        if name.endswith(".py"):
            shutil.copy2(os.path.join(src, folder, name), os.path.join(dest, name))
PY
cp -r "$_src/tests" "$_src/configs" "$_src/benchmarks" "$_src/pytest.ini" "$_work/"
[ -d "$_src/.peers" ] && cp -r "$_src/.peers" "$_work/"
export PYTHONPATH=$_site${PYTHONPATH:+:$PYTHONPATH}
cd "$_work"
