#!/usr/bin/env bash
# Install what the tests need beyond Python: a Prometheus server and promtool, which the
# rule tests (promtool check/test rules) and the real-Prometheus integration test run, and
# Alertmanager's amtool, which checks the example deploy/alertmanager/alertmanager.yml.
# Idempotent: does nothing when all three are already on PATH. `make test` runs it first.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 \
        && command -v amtool >/dev/null 2>&1; then
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "install-test-deps: prometheus/promtool/amtool not on PATH; run 'sudo bash scripts/install-test-deps.sh' (installs the Debian packages 'prometheus' and 'prometheus-alertmanager') or put the three binaries on PATH" >&2
    exit 1
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-test-deps: prometheus/promtool/amtool not on PATH and no apt-get here; install Prometheus (server and promtool) and Alertmanager (amtool) from https://prometheus.io/download/ and put the three on PATH" >&2
    exit 1
fi

# The packages' postinst scripts start Prometheus and Alertmanager services (invoke-rc.d,
# or systemd where it runs). The tests start their own on a free port; a system one would
# only hold :9090 and :9093 and, in a container without an init system, fail noisily. A
# policy-rc.d that denies service actions is what Debian provides for exactly this
# (deb-systemd-invoke honours it too). Leave an existing policy-rc.d alone; remove ours on
# any exit.
policy=/usr/sbin/policy-rc.d
created_policy=0
cleanup() {
    if [ "$created_policy" = 1 ]; then
        rm -f "$policy"
    fi
}
trap cleanup EXIT
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\n# temporary, from gemmd scripts/install-test-deps.sh\nexit 101\n' >"$policy"
    chmod 755 "$policy"
    created_policy=1
fi

echo "install-test-deps: installing the Debian packages 'prometheus' (server and promtool) and 'prometheus-alertmanager' (amtool)" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    prometheus prometheus-alertmanager >/dev/null

for tool in prometheus promtool amtool; do
    if ! command -v "$tool" >/dev/null 2>&1; then
        echo "install-test-deps: '$tool' still not on PATH after installing the package" >&2
        exit 1
    fi
done
echo "install-test-deps: $(prometheus --version 2>&1 | head -n 1)" >&2
echo "install-test-deps: $(amtool --version 2>&1 | head -n 1)" >&2
