#!/bin/bash
# Reward 1 for {"best": "cyd", "total": 100}.
if python3 -c 'import json; r = json.load(open("/app/report.json")); assert r == {"best": "cyd", "total": 100}, r'; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
