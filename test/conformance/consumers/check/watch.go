package check

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
)

// Watch mode (--watch): instead of one list, the checker starts the
// consumer's own watch machinery (a client-go informer, Argo CD's cluster
// cache) on ConfigMaps of the list namespace, with the REST config the
// consumer's code built from the Secret, and prints one WatchEvent per
// line as things happen. It exits 1 once the consumer has lost the
// cluster (every watch stream ended and a request was refused after
// that: "lost"), 0 when interrupted, and as in the list mode when the
// consumer refuses the Secret or the cache never syncs.

// The events of watch mode, in WatchEvent.Event.
const (
	// EventSynced: the informer or cache listed and is watching;
	// ConfigMaps are what it holds, Server is where it went.
	EventSynced = "synced"
	// EventAdded: the watch delivered a ConfigMap created after the sync
	// (Name).
	EventAdded = "added"
	// EventWatchEnded: a watch stream that was open ended (Error says
	// how; Open how many remain open).
	EventWatchEnded = "watchEnded"
	// EventRefused: a request made after the sync was answered 401 or
	// 403 (Status, Path, Error: the answer's message).
	EventRefused = "refused"
	// EventLost: no watch stream is open any more and a request to
	// re-establish one was refused; the checker exits 1.
	EventLost = "lost"
)

// WatchEvent is one line of watch mode.
type WatchEvent struct {
	Consumer string `json:"consumer"`
	Event    string `json:"event"`
	// At is when the checker saw it (RFC 3339 with nanoseconds).
	At         time.Time `json:"at"`
	Server     string    `json:"server,omitempty"`
	ConfigMaps []string  `json:"configMaps,omitempty"`
	Name       string    `json:"name,omitempty"`
	Status     int       `json:"status,omitempty"`
	Path       string    `json:"path,omitempty"`
	Error      string    `json:"error,omitempty"`
	// Open is the number of watch streams open after the event.
	Open int `json:"open"`
}

// WatchFunc starts a consumer's watch machinery with the client its code
// built from the Secret a names, calls w.Observe on that client's REST
// config before anything uses it, and returns once it has called
// w.Synced. What it started may run until the process exits. An
// ErrRefused is the consumer refusing the Secret.
type WatchFunc func(ctx context.Context, a Args, w *Watcher) error

// Option changes what Main offers.
type Option func(*options)

type options struct{ watch WatchFunc }

// WithWatch gives the checker a watch mode (--watch).
func WithWatch(fn WatchFunc) Option { return func(o *options) { o.watch = fn } }

// Watcher prints the events of watch mode and tells when the consumer
// has lost the cluster. It sees the consumer's requests through the
// transport of the REST config it observes, so what it reports is what
// the consumer's own client did.
type Watcher struct {
	consumer string
	out      io.Writer

	mu      sync.Mutex
	synced  bool
	open    int
	ended   bool // a watch stream ended after the sync
	refused bool // and a request was refused after that
	lost    chan struct{}
}

func newWatcher(consumer string, out io.Writer) *Watcher {
	return &Watcher{consumer: consumer, out: out, lost: make(chan struct{})}
}

// Lost is closed when the consumer has lost the cluster.
func (w *Watcher) Lost() <-chan struct{} { return w.lost }

// Synced reports that the consumer's cache has listed and is watching.
func (w *Watcher) Synced(server string, configMaps []string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.synced = true
	slices.Sort(configMaps)
	w.emit(WatchEvent{Event: EventSynced, Server: server, ConfigMaps: configMaps})
}

// Added reports a ConfigMap the watch delivered after the sync.
func (w *Watcher) Added(name string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.emit(WatchEvent{Event: EventAdded, Name: name})
}

// emit prints ev; w.mu is held.
func (w *Watcher) emit(ev WatchEvent) {
	ev.Consumer, ev.At, ev.Open = w.consumer, time.Now(), w.open
	line, _ := json.Marshal(ev)
	_, _ = w.out.Write(append(line, '\n'))
}

func (w *Watcher) opened() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.open++
}

func (w *Watcher) streamEnded(err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.open--
	if !w.synced {
		return
	}
	w.ended = true
	msg := "closed by the client"
	if err != nil {
		msg = err.Error()
	}
	w.emit(WatchEvent{Event: EventWatchEnded, Error: msg})
	w.checkLost()
}

func (w *Watcher) refusal(path string, status int, body string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.synced {
		// Before the sync a refusal is the consumer's discovery of
		// what its RBAC allows (Argo CD's respectRBAC).
		return
	}
	w.emit(WatchEvent{Event: EventRefused, Status: status, Path: path, Error: body})
	if w.ended {
		w.refused = true
		w.checkLost()
	}
}

// checkLost closes lost once; w.mu is held.
func (w *Watcher) checkLost() {
	if w.ended && w.refused && w.open == 0 {
		select {
		case <-w.lost:
		default:
			w.emit(WatchEvent{Event: EventLost})
			close(w.lost)
		}
	}
}

// Observe puts the watcher in cfg's transport, after whatever wraps it
// already: it counts the watch streams answered 200 until each ends, and
// reports the requests answered 401 or 403 with the answer's message.
func (w *Watcher) Observe(cfg *rest.Config) {
	prev := cfg.WrapTransport
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		if prev != nil {
			rt = prev(rt)
		}
		return &observed{next: rt, w: w}
	}
}

type observed struct {
	next http.RoundTripper
	w    *Watcher
}

func (o *observed) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := o.next.RoundTrip(req)
	if err != nil {
		return resp, err
	}
	switch q := req.URL.Query().Get("watch"); {
	case resp.StatusCode == http.StatusUnauthorized || resp.StatusCode == http.StatusForbidden:
		// The body is a Status of a few hundred bytes; read it for the
		// report and hand the caller the same bytes.
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
		_ = resp.Body.Close()
		resp.Body = io.NopCloser(bytes.NewReader(body))
		o.w.refusal(req.URL.Path, resp.StatusCode, statusMessage(body))
	case resp.StatusCode == http.StatusOK && (q == "true" || q == "1"):
		o.w.opened()
		resp.Body = &watchBody{ReadCloser: resp.Body, w: o.w}
	}
	return resp, nil
}

// watchBody reports the end of a watch stream once: its first read
// error (EOF included) or its close.
type watchBody struct {
	io.ReadCloser
	w    *Watcher
	once sync.Once
}

func (b *watchBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err != nil {
		b.once.Do(func() { b.w.streamEnded(err) })
	}
	return n, err
}

func (b *watchBody) Close() error {
	b.once.Do(func() { b.w.streamEnded(nil) })
	return b.ReadCloser.Close()
}

// statusMessage is the message of a metav1.Status body, or the body.
func statusMessage(body []byte) string {
	var s struct {
		Message string `json:"message"`
	}
	if json.Unmarshal(body, &s) == nil && s.Message != "" {
		return s.Message
	}
	return string(body)
}

// InformerWatch is the watch mode of a consumer whose controllers watch
// the target with client-go informers: a shared informer factory on the
// list namespace, with the REST config the consumer's code built, and its
// ConfigMap informer.
func InformerWatch(ctx context.Context, cfg *rest.Config, a Args, w *Watcher) error {
	w.Observe(cfg)
	cs, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return ErrRefused{Err: err}
	}
	factory := informers.NewSharedInformerFactoryWithOptions(cs, 0, informers.WithNamespace(a.ListNamespace))
	inf := factory.Core().V1().ConfigMaps().Informer()
	// A refused first list would otherwise leave the informer retrying
	// until the deadline: give up at once, as the list mode does.
	syncCtx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	if err := inf.SetWatchErrorHandler(func(_ *cache.Reflector, err error) {
		if apierrors.IsUnauthorized(err) || apierrors.IsForbidden(err) {
			cancel(err)
		}
	}); err != nil {
		return err
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerDetailedFuncs{
		AddFunc: func(obj any, isInInitialList bool) {
			if cm, ok := obj.(*corev1.ConfigMap); ok && !isInInitialList {
				w.Added(cm.Name)
			}
		},
	}); err != nil {
		return err
	}
	factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(syncCtx.Done(), inf.HasSynced) {
		return fmt.Errorf("the informer did not sync: %w", context.Cause(syncCtx))
	}
	var names []string
	for _, obj := range inf.GetStore().List() {
		if cm, ok := obj.(*corev1.ConfigMap); ok {
			names = append(names, cm.Name)
		}
	}
	w.Synced(cfg.Host, names)
	return nil
}

// runWatch is Main's watch mode; it returns the exit status.
func runWatch(consumer string, fn WatchFunc, a Args) int {
	ctx, stop := signalContext()
	defer stop()
	w := newWatcher(consumer, os.Stdout)
	syncCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- fn(ctx, a, w) }()
	select {
	case err := <-done:
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: %v\n", consumer, err)
			return 1
		}
	case <-syncCtx.Done():
		fmt.Fprintf(os.Stderr, "%s: the watch did not sync within a minute\n", consumer)
		return 1
	}
	select {
	case <-w.Lost():
		return 1
	case <-ctx.Done():
		return 0
	}
}

// Loaded is Main for a consumer whose own code turns the Secret into a
// REST config (load): the check lists with it, and the watch mode runs a
// client-go informer on it, as the consumer's controllers do.
func Loaded(consumer string, load func(ctx context.Context, a Args) (*rest.Config, error)) {
	Main(consumer, func(ctx context.Context, a Args) (*Result, error) {
		cfg, err := load(ctx, a)
		if err != nil {
			return nil, err
		}
		return ListWith(ctx, cfg, a)
	}, WithWatch(func(ctx context.Context, a Args, w *Watcher) error {
		cfg, err := load(ctx, a)
		if err != nil {
			return err
		}
		return InformerWatch(ctx, cfg, a, w)
	}))
}
