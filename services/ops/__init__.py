"""Operations on a run and its deployment, above running one (`services.driver`): the queue's audit (`marge audit`,
`marge queue`), the Redis users of a deployment (`marge redis-users`), a run's report (`marge report`) and the
config reference (`marge config reference`). They read what a run wrote and the driver's config; the driver imports
nothing of them."""
