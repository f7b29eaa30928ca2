#!/bin/bash
# Reward 1 when agent owns notes.txt and it says "mine".
f=/home/agent/notes.txt
if [ "$(stat -c %U "$f" 2>/dev/null)" = agent ] && [ "$(cat "$f")" = mine ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
