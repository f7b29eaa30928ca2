#!/bin/bash
# Relative: the image's WORKDIR (/app) is where commands start, as with harbor's docker environment.
echo "Hello, world!" > hello.txt
