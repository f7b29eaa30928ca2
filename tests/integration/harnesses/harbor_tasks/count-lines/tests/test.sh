#!/bin/bash
# 500 lines, every seventh an ERROR: 72.
if [ "$(cat /app/errors.txt 2>/dev/null)" = "72" ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
