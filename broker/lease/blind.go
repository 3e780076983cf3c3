package lease

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/tokenbroker/tokenbroker/broker/objects"
)

// BlindAfter is how long a namespace's lease watch may be closed (or its
// first list not done) before the counter is Blind there. A watch the API
// server ends in the normal way is re-opened at once (its timeout, every
// 5 to 10 minutes) or after client-go's first backoff of 0.8 to 1.6 s and
// a relist (an expired resource version): 3 s is past both, so a healthy
// replica is never blind. A connection cut or refused ends the watch at
// once; one that dies silently (a dropped route, a frozen peer) is found
// by client-go's HTTP/2 health check, a ping after 30 s without a frame
// answered within 15 s (HTTP2_READ_IDLE_TIMEOUT_SECONDS,
// HTTP2_PING_TIMEOUT_SECONDS), so the counter is blind at most about
// 45 s + BlindAfter after such a death.
const BlindAfter = 3 * time.Second

// Blind reports whether the counter's view of the leases of namespace may
// be stale at now: a watch that would hold them (the namespace's own, or
// the cluster-wide one) has been closed for longer than BlindAfter (or
// open but still streaming the initial list of a relist), or has not
// listed once BlindAfter after it started. A blind counter may still
// hold a lease deleted since: ask the API server (Recheck). A namespace
// the counter does not watch is not blind: the counter holds nothing
// there.
func (lc *Counter) Blind(namespace string, now time.Time) bool {
	lc.mu.Lock()
	defer lc.mu.Unlock()
	for _, ns := range []string{metav1.NamespaceAll, namespace} {
		if w := lc.watches[ns]; w != nil && !(w.open && w.synced.Load()) && now.Sub(w.since) > BlindAfter {
			return true
		}
	}
	return false
}

// tracked wraps the watch wi that the reflector of w opened, so that w is
// open until its events end: from now, or, for a streaming list
// (initial), from the Replace of its initial events.
func (lc *Counter) tracked(w *nsWatch, wi watch.Interface, initial bool) watch.Interface {
	lc.mu.Lock()
	w.watching, w.open = true, !initial
	lc.mu.Unlock()
	t := &trackedWatch{inner: wi, out: make(chan watch.Event), stop: make(chan struct{})}
	go t.run(func() {
		lc.mu.Lock()
		defer lc.mu.Unlock()
		if w.open {
			w.since = lc.clock.Now()
		}
		w.watching, w.open = false, false
	})
	return t
}

// trackedWatch passes a watch's events on and calls closed when they end,
// before its own channel closes.
type trackedWatch struct {
	inner watch.Interface
	out   chan watch.Event
	stop  chan struct{}
	once  sync.Once
}

func (t *trackedWatch) run(closed func()) {
	defer close(t.out)
	defer closed()
	for ev := range t.inner.ResultChan() {
		select {
		case t.out <- ev:
		case <-t.stop:
			// Stopped: nobody reads; the inner watch closes its channel
			// soon (Stop), which ends the loop.
		}
	}
}

func (t *trackedWatch) Stop() {
	t.once.Do(func() {
		close(t.stop)
		t.inner.Stop()
	})
}

func (t *trackedWatch) ResultChan() <-chan watch.Event { return t.out }

// Recheck asks the API server, not the counter's memory, whether the
// lease Secret namespace/name under uid is a live lease issued to the
// peer identity identity at now, with the checks of Holds: an intact
// lease Secret (Intact: the lease type and every mark the broker writes,
// so not a pooled one) under uid that the counter has not seen edited
// since it was intact, not being deleted, that the policy bears out (its
// namespace, peer label and identity annotation), whose recorded expiry
// is readable and not passed, and whose identity annotation is identity.
// expires is that expiry. A lease the API server does not have is
// ok=false with no error; any error is the API server's (retryable), and
// says nothing of the lease.
//
// It reads with a consistent LIST that the API server serves as a GET of
// the one Secret (a field selector on metadata.name), so that the Secret's
// type is checked by the API server as the counter's own watch has it
// checked (metadata carries no type), and with the RBAC the counter
// already needs (list). It changes nothing in the counter: ending a gone
// lease's connections from here would close the connection of the
// request that asked before its answer; they end when the watch is back.
func (lc *Counter) Recheck(ctx context.Context, namespace, name string, uid types.UID, identity string, now time.Time) (expires time.Time, ok bool, err error) {
	if lc.client == nil {
		return time.Time{}, false, errors.New("recheck lease: the counter has no API client")
	}
	// By name and type, not by label: a label edit must not hide the
	// Secret from the check that refuses it.
	list, err := lc.client.Resource(SecretsGVR).Namespace(namespace).List(ctx, metav1.ListOptions{
		FieldSelector: NamedSelector(name),
	})
	if err != nil {
		return time.Time{}, false, fmt.Errorf("recheck lease %s/%s: %w", namespace, name, err)
	}
	var m *metav1.PartialObjectMetadata
	for i := range list.Items {
		if list.Items[i].Name == name && list.Items[i].Namespace == namespace {
			m = &list.Items[i]
		}
	}
	if m == nil || m.UID != uid || m.DeletionTimestamp != nil {
		return time.Time{}, false, nil
	}
	id := bounded(m.Annotations[objects.AnnotationIdentity], maxKeptIdentity)
	if !intactMeta(m.Name, m.Labels, m.Annotations) || id != identity {
		return time.Time{}, false, nil
	}
	if _, tampered := lc.TamperedHolder(namespace, name, uid); tampered {
		return time.Time{}, false, nil
	}
	if !lc.currentRules().verify(namespace, m.Labels[objects.LabelPeer], id) {
		return time.Time{}, false, nil
	}
	exp, perr := time.Parse(time.RFC3339, m.Annotations[objects.AnnotationExpiresAt])
	if perr != nil || !now.Before(exp) {
		return time.Time{}, false, nil
	}
	return exp, true, nil
}
