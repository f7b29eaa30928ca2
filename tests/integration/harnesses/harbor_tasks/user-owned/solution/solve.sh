#!/bin/bash
set -e
useradd --create-home agent
su agent -s /bin/bash -c 'echo mine > /home/agent/notes.txt' 2>/dev/null || runuser -u agent -- sh -c 'echo mine > /home/agent/notes.txt'
