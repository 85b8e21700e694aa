# Source this on a GPU machine that has torch/triton but cannot pip-install the package (no network,
# no editable install): it lays the package out as setup.py's package_dir does, in /tmp/site, copies
# the tests/configs/benchmarks to /tmp/w and cd's there, so `pytest -m gpu` and the benchmarks import
# the megassm of this checkout.
export PYTHONUNBUFFERED=1
_src=$(pwd)
rm -rf /tmp/site /tmp/w && mkdir -p /tmp/site /tmp/w
cp -r "$_src/megassm" /tmp/site/
cp -r "$_src/kernels" /tmp/site/megassm/kernels
cp -r "$_src/data_tools" /tmp/site/megassm/data_tools
cp -r "$_src/launch" /tmp/site/megassm/launch
cp -r "$_src/tests" "$_src/configs" "$_src/benchmarks" "$_src/pytest.ini" /tmp/w/
[ -d "$_src/.peers" ] && cp -r "$_src/.peers" /tmp/w/
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
cd /tmp/w
