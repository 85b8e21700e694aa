# Source this on a GPU machine that has torch/triton but cannot pip-install the package (no network,
# no editable install): it lays the package out as setup.py's package_dir does, in /tmp/site, copies
# the tests/configs/benchmarks to /tmp/w and cd's there, so `pytest -m gpu` and the benchmarks import
# the megassm of this checkout. DEVICE_SITE / DEVICE_WORK name other folders, for two checkouts side by side.
export PYTHONUNBUFFERED=1
_src=$(pwd)
_site=${DEVICE_SITE:-/tmp/site}
_work=${DEVICE_WORK:-/tmp/w}
rm -rf "$_site" "$_work" && mkdir -p "$_site" "$_work"
cp -r "$_src/megassm" "$_site/"
cp -r "$_src/kernels" "$_site/megassm/kernels"
cp -r "$_src/data_tools" "$_site/megassm/data_tools"
cp -r "$_src/launch" "$_site/megassm/launch"
cp -r "$_src/tests" "$_src/configs" "$_src/benchmarks" "$_src/pytest.ini" "$_work/"
[ -d "$_src/.peers" ] && cp -r "$_src/.peers" "$_work/"
export PYTHONPATH=$_site${PYTHONPATH:+:$PYTHONPATH}
cd "$_work"
