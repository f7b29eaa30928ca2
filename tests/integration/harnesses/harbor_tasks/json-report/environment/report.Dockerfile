FROM debian-python AS data
ARG SCORES=scores.csv
RUN printf 'name,score\nada,31\nbob,17\ncyd,44\ndee,8\n' > /$SCORES

FROM debian-python
ARG SCORES=scores.csv
WORKDIR /srv
COPY --from=data /$SCORES /app/$SCORES
