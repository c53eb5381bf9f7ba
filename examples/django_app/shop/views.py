"""Placing an order writes the order and its close task in one ``transaction.atomic()``:
both commit, or neither does. Paying cancels the close task by its business key."""

from __future__ import annotations

import json

from django.conf import settings
from django.db import connection, transaction
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

import ax_kombu as ax
from shop.models import Order
from shop.tasks import close_order


class PaymentProviderDown(RuntimeError):
    pass


@csrf_exempt
@require_POST
def create_order(request: HttpRequest) -> JsonResponse:
    body = json.loads(request.body or b"{}")
    with transaction.atomic():
        order = Order.objects.create(customer=body["customer"],
                                     amount_cents=int(body["amount_cents"]))
        close_order.enqueue(order.pk, delay=settings.ORDER_CLOSE_AFTER_S,
                            biz_key=str(order.pk), connection=connection)
        if body.get("fail"):  # the rest of the request failed: order and task roll back
            raise PaymentProviderDown("the payment provider is down")
    return JsonResponse({"order": order.pk}, status=201)


@csrf_exempt
@require_POST
def pay_order(request: HttpRequest, order_id: int) -> JsonResponse:
    with transaction.atomic():
        paid = Order.objects.filter(pk=order_id, status="unpaid").update(status="paid")
        if paid:
            ax.cancel(task_type=close_order.task_type, biz_key=str(order_id))
    return JsonResponse({"paid": bool(paid)})
