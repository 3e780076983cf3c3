package workload

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"

	"github.com/tokenbroker/tokenbroker/broker/informer"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/problem"
	"github.com/tokenbroker/tokenbroker/pki"
)

// The key sets that peers upload (workloadIdentity.jwksFromPeer) live in
// one Secret per peer in the broker's namespace, so that every replica
// verifies with the same keys:
//
//	name        tokenbroker-jwks-<peer>
//	labels      app.kubernetes.io/managed-by=tokenbroker,
//	            tokenbroker.io/kind=jwks, tokenbroker.io/peer=<peer>
//	annotations tokenbroker.io/identity (the uploader's SPIFFE ID),
//	            tokenbroker.io/replaced-at (when jwks.json last changed)
//	            tokenbroker.io/pods-reported-at (when live-pods.json was
//	            last reported)
//	data        jwks.json (the set in force), previous.json (the one it
//	            replaced, which verifies for workloadIdentity.jwksOverlap
//	            after replaced-at), live-pods.json (the uids of the Pods
//	            of the peer's last report, workloadIdentity.livePodsFromPeer)
//
// A peer that trusts pod certificates alone (no token trust) reports its
// Pods without uploading keys: its Secret holds live-pods.json and no
// jwks.json. A peer can make the broker write exactly this one Secret, of
// at most twice pki.MaxJWKSBytes plus MaxLivePods uids.
const (
	PeerKeysCurrentKey       = "jwks.json"
	PeerKeysPreviousKey      = "previous.json"
	AnnotationJWKSReplacedAt = "tokenbroker.io/replaced-at"
	peerKeysSecretPrefix     = "tokenbroker-jwks-"
)

// PeerKeysSecretName is the name of a peer's key set Secret.
func PeerKeysSecretName(peer string) string { return peerKeysSecretPrefix + peer }

// peerKeySet is one peer's uploaded keys as read from its Secret.
type peerKeySet struct {
	identity string
	// current is nil for a Secret of live Pods alone (a peer that trusts
	// pod certificates only); previous is then nil too.
	current    *pki.JWKS
	previous   *pki.JWKS
	replacedAt time.Time
	// pods are the uids of the peer's last report of its live Pods, made
	// at podsAt (zero: none yet).
	pods   map[string]struct{}
	podsAt time.Time
}

// PeerKeyStore holds the key sets peers uploaded, kept current by Run,
// which watches their Secrets, and writes new ones (Put). Readers never
// block.
type PeerKeyStore struct {
	secrets   corev1client.SecretsGetter
	namespace string
	log       *zap.Logger

	mu     sync.Mutex // serialises writers of sets
	sets   atomic.Pointer[map[string]*peerKeySet]
	synced atomic.Bool

	reportsMu  sync.Mutex
	lastReport map[string]time.Time // per peer: this replica's last report
}

// NewPeerKeyStore returns a store of the key Secrets in namespace.
func NewPeerKeyStore(secrets corev1client.SecretsGetter, namespace string, log *zap.Logger) *PeerKeyStore {
	s := &PeerKeyStore{secrets: secrets, namespace: namespace, log: log}
	s.sets.Store(&map[string]*peerKeySet{})
	return s
}

// Synced reports whether the Secrets have been read once.
func (s *PeerKeyStore) Synced() bool { return s.synced.Load() }

// Run watches the key Secrets (selected by their kind label) until ctx is
// done.
func (s *PeerKeyStore) Run(ctx context.Context) {
	secrets := s.secrets.Secrets(s.namespace)
	sel := labels.SelectorFromSet(labels.Set{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.PeerKeysKind}).String()
	inf := informer.New(secrets, &corev1.Secret{},
		func(o *metav1.ListOptions) { o.LabelSelector = sel },
		func(err error) {
			s.log.Warn("watch of the peer key Secrets failed; retrying", zap.String("namespace", s.namespace), zap.Error(err))
		})
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { s.observe(obj) },
		UpdateFunc: func(_, obj any) { s.observe(obj) },
		DeleteFunc: func(obj any) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			if sec, ok := obj.(*corev1.Secret); ok {
				s.set(sec.Labels[objects.LabelPeer], nil)
			}
		},
	}) // fails only after the informer has stopped
	go func() {
		if cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
			s.synced.Store(true)
		}
	}()
	inf.RunWithContext(ctx)
}

// WaitForSync waits until the Secrets have been read once, or ctx is done.
func (s *PeerKeyStore) WaitForSync(ctx context.Context) error {
	err := wait.PollUntilContextCancel(ctx, 20*time.Millisecond, true, func(context.Context) (bool, error) { return s.Synced(), nil })
	if err != nil {
		return fmt.Errorf("wait for the peer key Secrets: %w", err)
	}
	return nil
}

func (s *PeerKeyStore) observe(obj any) {
	sec, ok := obj.(*corev1.Secret)
	if !ok || sec.Labels[objects.LabelPeer] == "" || sec.Name != PeerKeysSecretName(sec.Labels[objects.LabelPeer]) {
		return
	}
	ks, err := keySetFromSecret(sec)
	if err != nil {
		// Only the broker writes it, after validation; a hand-edited one
		// that does not parse verifies nothing.
		s.log.Warn("peer key Secret does not parse; the peer's workload tokens are refused until it uploads again",
			zap.String("secret", sec.Name), zap.Error(err))
		ks = nil
	}
	s.set(sec.Labels[objects.LabelPeer], ks)
}

func (s *PeerKeyStore) set(peer string, ks *peerKeySet) {
	s.mu.Lock()
	defer s.mu.Unlock()
	old := *s.sets.Load()
	next := make(map[string]*peerKeySet, len(old)+1)
	for k, v := range old {
		next[k] = v
	}
	if ks == nil {
		delete(next, peer)
	} else {
		next[peer] = ks
	}
	s.sets.Store(&next)
}

func keySetFromSecret(sec *corev1.Secret) (*peerKeySet, error) {
	ks := &peerKeySet{identity: sec.Annotations[objects.AnnotationIdentity]}
	doc, hasKeys := sec.Data[PeerKeysCurrentKey]
	if !hasKeys && len(sec.Data[PeerLivePodsKey]) == 0 {
		return nil, fmt.Errorf("%s: neither a key set nor a report of live Pods (%s)", PeerKeysCurrentKey, PeerLivePodsKey)
	}
	if hasKeys {
		var err error
		if ks.current, err = pki.ParseJWKS(doc); err != nil {
			return nil, fmt.Errorf("%s: %w", PeerKeysCurrentKey, err)
		}
	} else if len(sec.Data[PeerKeysPreviousKey]) > 0 {
		return nil, fmt.Errorf("%s without %s", PeerKeysPreviousKey, PeerKeysCurrentKey)
	}
	var err error
	if prev := sec.Data[PeerKeysPreviousKey]; len(prev) > 0 {
		if ks.previous, err = pki.ParseJWKS(prev); err != nil {
			return nil, fmt.Errorf("%s: %w", PeerKeysPreviousKey, err)
		}
		if ks.replacedAt, err = time.Parse(time.RFC3339, sec.Annotations[AnnotationJWKSReplacedAt]); err != nil {
			return nil, fmt.Errorf("%s: %w", AnnotationJWKSReplacedAt, err)
		}
	}
	if doc := sec.Data[PeerLivePodsKey]; len(doc) > 0 {
		if ks.pods, err = parseLivePods(doc); err != nil {
			return nil, fmt.Errorf("%s: %w", PeerLivePodsKey, err)
		}
		if ks.podsAt, err = time.Parse(time.RFC3339Nano, sec.Annotations[AnnotationPodsReportedAt]); err != nil {
			return nil, fmt.Errorf("%s: %w", AnnotationPodsReportedAt, err)
		}
	}
	return ks, nil
}

// Keys returns the sets that verify the tokens of peer (which must have
// been uploaded by identity) at now: the one in force and, until overlap
// after it was replaced, the previous one. None: nil.
func (s *PeerKeyStore) Keys(peer, identity string, now time.Time, overlap time.Duration) []*pki.JWKS {
	ks := (*s.sets.Load())[peer]
	if ks == nil || ks.identity != identity || ks.current == nil {
		return nil
	}
	if ks.previous != nil && now.Before(ks.replacedAt.Add(overlap)) {
		return []*pki.JWKS{ks.current, ks.previous}
	}
	return []*pki.JWKS{ks.current}
}

// PeerKeysUpdate is the outcome of Put.
type PeerKeysUpdate struct {
	// Changed is false when the set was already in force.
	Changed bool
	// Current and Previous are the key ids in force; PreviousUntil is when
	// the previous set stops verifying (zero without one).
	Current, Previous []string
	Digest            string
	PreviousUntil     time.Time
}

// Put stores set (raw is its validated document) as peer's set in force,
// keeping the one it replaces as previous, unless it has the same keys.
// A Secret written for another identity (a peer name reused in the policy)
// is replaced without keeping its keys. Conflicts with another replica are
// retried.
func (s *PeerKeyStore) Put(ctx context.Context, peer, identity string, raw []byte, set *pki.JWKS, now time.Time, overlap time.Duration) (PeerKeysUpdate, error) {
	secrets := s.secrets.Secrets(s.namespace)
	name := PeerKeysSecretName(peer)
	var out PeerKeysUpdate
	var written *corev1.Secret
	err := retry.OnError(retry.DefaultRetry, func(err error) bool {
		return apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err)
	}, func() error {
		out, written = PeerKeysUpdate{Current: set.KeyIDs(), Digest: set.Digest()}, nil
		// A list by labels, not a get: the broker's Role has no get on
		// Secrets (list, watch, create, update, delete).
		sec, err := s.read(ctx, peer)
		if apierrors.IsNotFound(err) {
			out.Changed = true
			written, err = secrets.Create(ctx, newPeerKeysSecret(peer, identity, raw), metav1.CreateOptions{})
			return err
		}
		if err != nil {
			return err
		}
		old, parseErr := keySetFromSecret(sec)
		sameOwner := parseErr == nil && old.identity == identity
		if sameOwner && old.current != nil && old.current.Digest() == set.Digest() {
			if old.previous != nil && now.Before(old.replacedAt.Add(overlap)) {
				out.Previous, out.PreviousUntil = old.previous.KeyIDs(), old.replacedAt.Add(overlap).UTC()
			}
			return nil
		}
		out.Changed = true
		next := newPeerKeysSecret(peer, identity, raw)
		next.ResourceVersion = sec.ResourceVersion
		if sameOwner {
			keepLivePods(sec, next)
		}
		if sameOwner && old.current != nil {
			next.Data[PeerKeysPreviousKey] = sec.Data[PeerKeysCurrentKey]
			next.Annotations[AnnotationJWKSReplacedAt] = now.UTC().Format(time.RFC3339)
			out.Previous, out.PreviousUntil = old.current.KeyIDs(), now.Add(overlap).UTC().Truncate(time.Second)
		}
		written, err = secrets.Update(ctx, next, metav1.UpdateOptions{})
		return err
	})
	if apierrors.IsNotFound(err) {
		// The broker's own namespace is missing: its misconfiguration,
		// not the peer's fault.
		return PeerKeysUpdate{}, problem.Wrap(problem.KindInternal, "", fmt.Errorf("store the key set of peer %s: namespace %q: %w", peer, s.namespace, err))
	}
	if err != nil {
		return PeerKeysUpdate{}, problem.Classify(fmt.Errorf("store the key set of peer %s in Secret %s/%s: %w", peer, s.namespace, name, err), "store key set", "namespace not found")
	}
	if written != nil {
		// Take it at once rather than when the watch delivers it, so the
		// uploader's next request verifies on this replica.
		s.observe(written)
	}
	return out, nil
}

// read returns peer's key set Secret, or a NotFound error.
func (s *PeerKeyStore) read(ctx context.Context, peer string) (*corev1.Secret, error) {
	sel := labels.SelectorFromSet(labels.Set{objects.LabelManagedBy: objects.ManagedByValue, objects.LabelKind: objects.PeerKeysKind, objects.LabelPeer: peer}).String()
	list, err := s.secrets.Secrets(s.namespace).List(ctx, metav1.ListOptions{LabelSelector: sel})
	if err != nil {
		return nil, err
	}
	for i := range list.Items {
		if list.Items[i].Name == PeerKeysSecretName(peer) {
			return &list.Items[i], nil
		}
	}
	return nil, apierrors.NewNotFound(corev1.Resource("secrets"), PeerKeysSecretName(peer))
}

func newPeerKeysSecret(peer, identity string, raw []byte) *corev1.Secret {
	return &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{
			Name: PeerKeysSecretName(peer),
			Labels: map[string]string{
				objects.LabelManagedBy: objects.ManagedByValue,
				objects.LabelKind:      objects.PeerKeysKind,
				objects.LabelPeer:      peer,
			},
			Annotations: map[string]string{objects.AnnotationIdentity: identity},
		},
		Type: objects.SecretTypePeerKeys,
		Data: map[string][]byte{PeerKeysCurrentKey: raw},
	}
}

// errNoPeerKeys is the cause of a refusal of a jwksFromPeer peer that has
// uploaded nothing (yet).
var ErrNoPeerKeys = errors.New("the peer has not uploaded its key set (PUT /v1/peers/self/jwks)")
