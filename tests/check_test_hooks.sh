#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# check_test_hooks.sh KVPOOLD KVPOOLD_TEST - the transfer test hooks (KVPOOL_XFER_TEST_*,
# compiled only with KVP_TEST_HOOKS) are in the test daemon and nowhere in the production one.
set -u
prod=$1
test=$2
rc=0
if grep -a -q "XFER_TEST" "$prod"; then
    echo "FAIL: $prod contains a transfer test hook name (XFER_TEST)"
    rc=1
fi
for hook in KVPOOL_XFER_TEST_STALL_MS KVPOOL_XFER_TEST_CHUNK_BYTES; do
    if ! grep -a -q "$hook" "$test"; then
        echo "FAIL: $test lacks the test hook $hook"
        rc=1
    fi
done
[ $rc -eq 0 ] && echo "ok: test hooks only in $(basename "$test")"
exit $rc
