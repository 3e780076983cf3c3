// Package policy is the broker's policy: who may have which credential for
// which ServiceAccount, for how long, and within which limits. It owns the
// document's types and its parsing and validation (Parse, CheckDocument,
// with field paths for every problem), the file and the key sets it names
// (LoadFile), the Store every request reads and the Watcher that swaps in a
// good new file and refuses a bad one, and every decision made from the
// document alone: Decide and DecideIn (deny by default, TTL clamps,
// audiences), namespaceSelector grants as pure functions over the namespace
// labels a caller supplies, the limits in force for a peer (LimitsFor), and
// the check of grants that let a holder outlive its lease
// (CheckPersistence).
//
// It reads nothing from the cluster but what CheckPersistence is given, and
// imports no other part of the core but problem and metrics.
package policy
