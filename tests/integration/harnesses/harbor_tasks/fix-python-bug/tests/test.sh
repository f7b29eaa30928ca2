#!/bin/bash
# Reward 1 when mean() is right on a few lists (the tests run the task's code with the image's python3).
cd /app
if python3 -c 'from stats import mean; assert mean([1, 2, 3]) == 2; assert mean([5]) == 5; assert mean([1.5, 2.5]) == 2'; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
