#!/bin/bash
# Run in the compose service's working_dir (/app), writing to its $REPORT.
python3 - <<'PY'
import csv, json, os
rows = list(csv.DictReader(open("scores.csv")))
best = max(rows, key=lambda r: int(r["score"]))["name"]
json.dump({"best": best, "total": sum(int(r["score"]) for r in rows)}, open(os.environ["REPORT"], "w"))
PY
