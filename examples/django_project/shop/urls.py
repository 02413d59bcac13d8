"""Routes: payments (sync and async), webhooks and the operation a 202 points to."""

from django.urls import include, path

from payorch.integrations.django import async_operation_view, async_webhook_view, urls

from . import payments

urlpatterns = [
    path("payments", payments.create_payment),
    path("async/payments", payments.create_payment_async),
    # POST payorch/webhooks/<tenant>/<provider>, GET payorch/operations/<operation_id>
    path("payorch/", include(urls())),
    # The same two served by async views (what urls(asynchronous=True) gives).
    path("async/webhooks/<str:tenant>/<str:provider>", async_webhook_view),
    path("async/operations/<str:operation_id>", async_operation_view),
    path("health", payments.health),
]
