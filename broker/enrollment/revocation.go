package enrollment

import (
	"context"
	"errors"
	"fmt"
	"math/big"
	"strings"
	"sync/atomic"
	"time"
	"unicode"

	"github.com/tokenbroker/tokenbroker/broker/informer"
	"github.com/tokenbroker/tokenbroker/broker/metrics"
	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/pki"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/util/wait"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"
)

// The revocation deny list lives in one ConfigMap in the broker's namespace,
// so that every replica enforces the same list and "kubectl get" shows it.
// Each data key holds one entry per line; whatever follows a '#' is a
// comment (AddRevocation writes the time and the reason there):
//
//	identities: |
//	  spiffe://oc.example/cluster/west  # 2025-01-02T03:04:05Z key leaked
//	serials: |
//	  3f9a0c...  # 2025-01-02T03:04:05Z laptop lost
//	pods: |
//	  6f1c2a9e-...  # 2025-01-02T03:04:05Z compromised Pod
//
// An identity is a cluster identity (every caller of that cluster) or a
// workload identity, spiffe://<td>/cluster/<name>/ns/<ns>/sa/<sa> (every
// pod certificate of that ServiceAccount). A pod is the uid of one Pod of
// a source cluster, as its pod certificates carry it (pki.WorkloadFromChain).
//
// Serials are hexadecimal as GET /v1/whoami shows them (lower case, no
// leading zeros); upper case and openssl's colon-separated form are
// accepted and normalised.
const (
	RevocationConfigMap     = "tokenbroker-revocations"
	RevocationKeyIdentities = "identities"
	RevocationKeySerials    = "serials"
	RevocationKeyPods       = "pods"
)

// Kinds of revocation entries.
const (
	RevokeIdentity = "identity"
	RevokeSerial   = "serial"
	RevokePod      = "pod"
)

// maxRevocationReason bounds the comment AddRevocation writes.
const maxRevocationReason = 200

// RevocationEntry is one line of the deny list.
type RevocationEntry struct {
	// Kind is RevokeIdentity, RevokeSerial or RevokePod.
	Kind string
	// Value is the identity, the serial in normal form, or the Pod's uid.
	Value string
	// Comment is what followed '#' on the line, trimmed.
	Comment string
}

// DenyList is a parsed revocation deny list. It is immutable; the zero
// value revokes nothing.
type DenyList struct {
	identities map[string]bool
	serials    map[string]bool
	pods       map[string]bool
}

// Revoked reports whether identity, or any of the certificate serials
// (hexadecimal, as NormalizeSerial returns them), is on the list.
func (d *DenyList) Revoked(identity string, serials ...string) bool {
	if d.identities[identity] {
		return true
	}
	for _, s := range serials {
		if d.serials[s] {
			return true
		}
	}
	return false
}

// RevokedPod reports whether the Pod of this uid is on the list.
func (d *DenyList) RevokedPod(uid string) bool { return uid != "" && d.pods[uid] }

// Len returns the number of identities and serials on the list.
func (d *DenyList) Len() (identities, serials int) { return len(d.identities), len(d.serials) }

// NormalizeSerial returns a certificate serial in the form the deny list
// and GET /v1/whoami use: lower-case hexadecimal without leading zeros.
// It accepts upper case and openssl's colon-separated bytes.
func NormalizeSerial(s string) (string, error) {
	h := strings.ToLower(strings.ReplaceAll(strings.TrimSpace(s), ":", ""))
	h = strings.TrimPrefix(h, "0x")
	if h == "" || len(h) > 64 {
		return "", fmt.Errorf("serial %q is not a hexadecimal certificate serial number", s)
	}
	n, ok := new(big.Int).SetString(h, 16)
	if !ok || n.Sign() < 0 {
		return "", fmt.Errorf("serial %q is not a hexadecimal certificate serial number", s)
	}
	return n.Text(16), nil
}

// ParseRevocations reads the entries of a deny list ConfigMap's data. A
// line that cannot be an entry (a serial that is not hexadecimal) is
// reported in problems and skipped, so that one typo never lifts the rest
// of the list.
func ParseRevocations(data map[string]string) (entries []RevocationEntry, problems []string) {
	for _, key := range []string{RevocationKeyIdentities, RevocationKeySerials, RevocationKeyPods} {
		for i, line := range strings.Split(data[key], "\n") {
			value, comment, _ := strings.Cut(line, "#")
			value = strings.TrimSpace(value)
			if value == "" {
				continue
			}
			e := RevocationEntry{Kind: RevokeIdentity, Value: value, Comment: strings.TrimSpace(comment)}
			switch key {
			case RevocationKeySerials:
				s, err := NormalizeSerial(value)
				if err != nil {
					problems = append(problems, fmt.Sprintf("%s line %d: %v", key, i+1, err))
					continue
				}
				e.Kind, e.Value = RevokeSerial, s
			case RevocationKeyPods:
				if err := validPodUID(value); err != nil {
					problems = append(problems, fmt.Sprintf("%s line %d: %v", key, i+1, err))
					continue
				}
				e.Kind = RevokePod
			}
			entries = append(entries, e)
		}
	}
	return entries, problems
}

// NewDenyList returns the deny list of entries (see ParseRevocations).
func NewDenyList(entries []RevocationEntry) *DenyList {
	d := &DenyList{identities: map[string]bool{}, serials: map[string]bool{}, pods: map[string]bool{}}
	for _, e := range entries {
		switch e.Kind {
		case RevokeSerial:
			d.serials[e.Value] = true
		case RevokePod:
			d.pods[e.Value] = true
		default:
			d.identities[e.Value] = true
		}
	}
	return d
}

// RevocationList is the deny list in force, kept current by Run, which
// watches the RevocationConfigMap in one namespace. Readers never block.
//
// Until the first list from the API server has arrived, Revoked answers
// true for everyone and Synced false: a broker that cannot read its deny
// list refuses every caller rather than let a revoked one in.
type RevocationList struct {
	configMaps corev1client.ConfigMapsGetter
	namespace  string
	log        *zap.Logger
	metrics    *metrics.Metrics

	current atomic.Pointer[DenyList]
}

// NewRevocationList returns a list that Run fills from the ConfigMap
// RevocationConfigMap in namespace. log is required; metrics may be nil.
func NewRevocationList(cms corev1client.ConfigMapsGetter, namespace string, log *zap.Logger, m *metrics.Metrics) *RevocationList {
	return &RevocationList{configMaps: cms, namespace: namespace, log: log, metrics: m}
}

// StaticRevocationList returns a list that holds d and is never updated,
// for tests and for brokers that run without the Kubernetes API. A nil d
// revokes nothing.
func StaticRevocationList(d *DenyList) *RevocationList {
	if d == nil {
		d = &DenyList{}
	}
	l := &RevocationList{}
	l.current.Store(d)
	return l
}

// Revoked reports whether the identity or any of the serials is revoked,
// and true for everything while the list is not yet synced.
func (l *RevocationList) Revoked(identity string, serials ...string) bool {
	d := l.current.Load()
	if d == nil {
		return true
	}
	return d.Revoked(identity, serials...)
}

// RevokedPod reports whether the Pod of this uid is revoked, and true for
// every Pod while the list is not yet synced.
func (l *RevocationList) RevokedPod(uid string) bool {
	d := l.current.Load()
	return d == nil || d.RevokedPod(uid)
}

// Synced reports whether the list has been read from the API server.
func (l *RevocationList) Synced() bool { return l.current.Load() != nil }

// Run watches the ConfigMap with an informer restricted to it (a field
// selector on its name) and swaps the list in force on every change, until
// ctx is done. Deleting the ConfigMap empties the list. Watch failures are
// logged and retried with the informer's backoff.
func (l *RevocationList) Run(ctx context.Context) {
	cms := l.configMaps.ConfigMaps(l.namespace)
	byName := fields.OneTermEqualSelector("metadata.name", RevocationConfigMap).String()
	inf := informer.New(cms, &corev1.ConfigMap{},
		func(o *metav1.ListOptions) { o.FieldSelector = byName },
		func(err error) {
			l.log.Warn("watch of the revocation ConfigMap failed; retrying",
				zap.String("namespace", l.namespace), zap.Error(err))
		})
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { l.update(obj) },
		UpdateFunc: func(_, obj any) { l.update(obj) },
		DeleteFunc: func(any) {
			l.store(&DenyList{})
			l.log.Warn("revocation ConfigMap deleted; nothing is revoked now", zap.String("namespace", l.namespace))
		},
	}) // fails only after the informer has stopped
	go func() {
		if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
			return
		}
		// No ConfigMap at all means nothing is revoked; an Add event that
		// arrived first has already stored the list.
		if l.current.CompareAndSwap(nil, &DenyList{}) {
			l.metrics.SetRevocations(0, 0)
		}
		l.log.Info("revocation list synced", zap.String("namespace", l.namespace))
	}()
	inf.RunWithContext(ctx)
}

// WaitForSync waits until the list has been read once, or ctx is done.
func (l *RevocationList) WaitForSync(ctx context.Context) error {
	return waitSynced(ctx, l.Synced, "the revocation list")
}

// waitSynced polls synced until it is true or ctx is done; what names
// the thing waited for in the error.
func waitSynced(ctx context.Context, synced func() bool, what string) error {
	err := wait.PollUntilContextCancel(ctx, 20*time.Millisecond, true, func(context.Context) (bool, error) { return synced(), nil })
	if err != nil {
		return fmt.Errorf("wait for %s: %w", what, err)
	}
	return nil
}

func (l *RevocationList) update(obj any) {
	cm, ok := obj.(*corev1.ConfigMap)
	if !ok || cm.Name != RevocationConfigMap {
		return
	}
	entries, problems := ParseRevocations(cm.Data)
	for _, p := range problems {
		l.log.Warn("revocation ConfigMap has an invalid entry; skipped", zap.String("problem", p))
	}
	d := NewDenyList(entries)
	l.store(d)
	ids, serials := d.Len()
	l.log.Info("revocation list updated",
		zap.String("resource_version", cm.ResourceVersion),
		zap.Int("identities", ids), zap.Int("serials", serials))
}

func (l *RevocationList) store(d *DenyList) {
	l.current.Store(d)
	l.metrics.SetRevocations(d.Len())
}

// AddRevocation adds one entry to the deny list ConfigMap in cms, creating
// the ConfigMap if it is missing, and retries when another writer got there
// first. kind is RevokeIdentity or RevokeSerial; reason is kept as a
// comment with the time at. It reports false when the value was already
// listed. Watching brokers enforce the new entry as soon as the change
// reaches them.
func AddRevocation(ctx context.Context, cms corev1client.ConfigMapInterface, kind, value, reason string, at time.Time) (added bool, err error) {
	key, value, err := revocationKey(kind, value)
	if err != nil {
		return false, err
	}
	line := value + "  # " + at.UTC().Format(time.RFC3339)
	if r := cleanReason(reason); r != "" {
		line += " " + r
	}
	err = retry.OnError(retry.DefaultRetry, func(err error) bool {
		return apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err)
	}, func() error {
		added = false
		cm, err := cms.Get(ctx, RevocationConfigMap, metav1.GetOptions{})
		exists := err == nil
		if apierrors.IsNotFound(err) {
			cm = &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{
				Name:   RevocationConfigMap,
				Labels: map[string]string{objects.LabelManagedBy: objects.ManagedByValue},
			}}
		} else if err != nil {
			return fmt.Errorf("get revocation ConfigMap: %w", err)
		}
		entries, _ := ParseRevocations(cm.Data)
		for _, e := range entries {
			if e.Kind == kind && e.Value == value {
				return nil
			}
		}
		if cm.Data == nil {
			cm.Data = map[string]string{}
		}
		old := cm.Data[key]
		if old != "" && !strings.HasSuffix(old, "\n") {
			old += "\n"
		}
		cm.Data[key] = old + line + "\n"
		added = true
		if exists {
			_, err = cms.Update(ctx, cm, metav1.UpdateOptions{})
		} else {
			_, err = cms.Create(ctx, cm, metav1.CreateOptions{})
		}
		return err
	})
	if err != nil {
		return false, fmt.Errorf("write revocation ConfigMap: %w", err)
	}
	return added, nil
}

// ReadRevocations returns the entries of the deny list ConfigMap in cms
// (none if it does not exist) and the problems of lines that are skipped.
func ReadRevocations(ctx context.Context, cms corev1client.ConfigMapInterface) ([]RevocationEntry, []string, error) {
	cm, err := cms.Get(ctx, RevocationConfigMap, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, fmt.Errorf("get revocation ConfigMap: %w", err)
	}
	entries, problems := ParseRevocations(cm.Data)
	return entries, problems, nil
}

func revocationKey(kind, value string) (key, normalized string, err error) {
	value = strings.TrimSpace(value)
	switch kind {
	case RevokeIdentity:
		// A workload identity (its pod certificates), else a cluster's.
		if _, _, _, err := pki.ParseWorkloadIdentity(value); err == nil {
			return RevocationKeyIdentities, value, nil
		}
		if err := policy.ValidSPIFFEID(value); err != nil {
			return "", "", fmt.Errorf("identity: %w (or a workload identity, <cluster identity>/ns/<namespace>/sa/<serviceAccount>)", err)
		}
		return RevocationKeyIdentities, value, nil
	case RevokeSerial:
		s, err := NormalizeSerial(value)
		if err != nil {
			return "", "", err
		}
		return RevocationKeySerials, s, nil
	case RevokePod:
		if err := validPodUID(value); err != nil {
			return "", "", err
		}
		return RevocationKeyPods, value, nil
	}
	return "", "", errors.New("revocation kind must be identity, serial or pod")
}

// cleanReason keeps a reason on one line of printable text.
func cleanReason(r string) string {
	r = strings.Map(func(c rune) rune {
		if !unicode.IsPrint(c) {
			return ' '
		}
		return c
	}, r)
	r = strings.Join(strings.Fields(r), " ")
	if len(r) > maxRevocationReason {
		r = strings.ToValidUTF8(r[:maxRevocationReason], "")
	}
	return r
}

// validPodUID checks that s can be a Pod's uid as the API server makes
// them: a UUID in its canonical lower-case form.
func validPodUID(s string) error {
	if !pki.ValidUID(s) {
		return fmt.Errorf("pod %q is not a Pod uid (a lower-case UUID, as \"kubectl get pod -o jsonpath={.metadata.uid}\" prints it)", s)
	}
	return nil
}
