"""``python -m examples.orders init | place CUSTOMER CENTS [--close-after S] | pay ORDER |
extend ORDER SECONDS``: drive the app of :mod:`examples.orders.app` by hand."""

from __future__ import annotations

import argparse
import sys

import ax_kombu as ax
from examples.orders.app import (
    Base,
    Sessions,
    create_order,
    engine,
    extend_order,
    pay_order,
)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.orders")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("init", help="create the orders table")
    place = commands.add_parser("place", help="place an order")
    place.add_argument("customer")
    place.add_argument("cents", type=int)
    place.add_argument("--close-after", type=float, default=1800.0, metavar="SECONDS")
    commands.add_parser("pay", help="pay an order").add_argument("order", type=int)
    extend = commands.add_parser("extend", help="give an order more time to be paid")
    extend.add_argument("order", type=int)
    extend.add_argument("seconds", type=float)
    args = parser.parse_args()

    if args.command == "init":
        Base.metadata.create_all(engine)
    elif args.command == "place":
        with Sessions.begin() as session:
            order = create_order(session, args.customer, args.cents, args.close_after)
            print(f"order {order.id}: closes in {args.close_after:g} s unless paid")
    elif args.command == "pay":
        print("paid" if pay_order(args.order) else "not unpaid: nothing done")
    else:
        try:
            task = extend_order(args.order, args.seconds)
        except ax.AxError as e:  # TooLateToMove, IllegalTransition, TaskNotFound
            sys.exit(f"order {args.order}: {e}")
        print(f"order {args.order}: closes in {args.seconds:g} s unless paid "
              f"(task {task.task_id})")


if __name__ == "__main__":
    main()
