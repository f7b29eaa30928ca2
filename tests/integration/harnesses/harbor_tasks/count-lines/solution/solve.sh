#!/bin/bash
grep -c ERROR /data/log.txt > /app/errors.txt
