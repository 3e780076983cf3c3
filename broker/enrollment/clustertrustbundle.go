package enrollment

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	certificatesv1 "k8s.io/api/certificates/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	certificatesv1client "k8s.io/client-go/kubernetes/typed/certificates/v1"
	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/broker/objects"
	"github.com/tokenbroker/tokenbroker/pki"
)

// ErrBundleNotOwned is returned (wrapped) by a publisher's Sync when a
// ClusterTrustBundle of the name it writes exists but was not made by this
// broker (no app.kubernetes.io/managed-by=tokenbroker label, another
// signer, or an AnnotationBroker that names another broker or is missing):
// the broker leaves it alone. Retryable only once an operator deletes it.
var ErrBundleNotOwned = errors.New("the ClusterTrustBundle exists and is not the broker's")

// AnnotationBroker on a published ClusterTrustBundle names the broker that
// made it (its policy's cluster.name). Two brokers given the same signer
// in one cluster would otherwise overwrite each other's CAs; with it, the
// second refuses to touch the first one's bundle.
const AnnotationBroker = "tokenbroker.io/broker"

// Defaults of ClusterTrustBundleConfig.
const (
	// DefaultBundleCheckInterval is how often the files are compared with
	// what was last published: a rotation reaches the cluster about that
	// long after the files change.
	DefaultBundleCheckInterval = time.Second
	// DefaultBundleResync is how often the object is read back even when
	// the files did not change, so that a bundle deleted or edited by hand
	// is put back.
	DefaultBundleResync = 5 * time.Minute
	// bundleMinBackoff and bundleMaxBackoff bound the wait after a failed
	// write.
	bundleMinBackoff = time.Second
	bundleMaxBackoff = 5 * time.Minute
)

// ClusterTrustBundleConfig configures a ClusterTrustBundlePublisher.
type ClusterTrustBundleConfig struct {
	// Client writes the bundle; it needs get, create and update on
	// clustertrustbundles and attest on the signer. Required.
	Client certificatesv1client.ClusterTrustBundleInterface
	// SignerName links the bundle to a signer (pki.ValidSignerName);
	// the bundle is named pki.ClusterTrustBundleName(SignerName).
	SignerName string
	// Owner names this broker (its policy's cluster.name); it is written
	// to AnnotationBroker and a bundle that names another is not touched.
	// Required.
	Owner string
	// Bundle returns the CA certificates to publish: the CAs that anchor
	// the broker's own server certificate (PublishedCAs). Called at
	// every check, it is where the files are reloaded. Required.
	Bundle func() []*x509.Certificate
	// Interval and Resync: see the Default constants; zero means those.
	Interval, Resync time.Duration
	// Clock drives the schedule; nil means the wall clock.
	Clock  clock.Clock
	Logger *zap.Logger
	// Registerer receives the publisher's metrics (see
	// ClusterTrustBundlePublisher); nil registers none.
	Registerer prometheus.Registerer
}

// ClusterTrustBundlePublisher keeps one signer-linked ClusterTrustBundle
// equal to the CA certificates the broker serves, so that clusters that
// trust the broker can take its CA from the API (a kubelet projection, the
// agent's identity.trustBundleFrom) rather than from a copied Secret. It
// owns only the object it created (labelled
// app.kubernetes.io/managed-by=tokenbroker, with its signer, and annotated
// AnnotationBroker with its own name) and never
// deletes it: a broker stopping is no reason for its peers to lose trust.
// Every replica writes the same content, so replicas agree.
//
// Metrics:
//
//	tokenbroker_cluster_trust_bundle_syncs_total{result}  writes and checks of the bundle, "success" or "failure"
//	tokenbroker_cluster_trust_bundle_not_owned_total      checks that found the bundle made by someone else (another broker, a person) and left it alone
//	tokenbroker_cluster_trust_bundle_in_sync              1 when the bundle was last found or made equal to what the broker serves, else 0
type ClusterTrustBundlePublisher struct {
	cfg  ClusterTrustBundleConfig
	name string
	log  *zap.Logger

	syncs    *prometheus.CounterVec
	inSync   prometheus.Gauge
	notOwned prometheus.Counter

	published []byte // the PEM last found or made in the cluster
	nextCheck time.Time
	failures  int
}

// NewClusterTrustBundlePublisher checks cfg and registers the metrics.
func NewClusterTrustBundlePublisher(cfg ClusterTrustBundleConfig) (*ClusterTrustBundlePublisher, error) {
	if cfg.Client == nil || cfg.Bundle == nil || cfg.Owner == "" {
		return nil, errors.New("cluster trust bundle: Client, Owner and Bundle are required")
	}
	if err := pki.ValidSignerName(cfg.SignerName); err != nil {
		return nil, fmt.Errorf("cluster trust bundle: %w", err)
	}
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultBundleCheckInterval
	}
	if cfg.Resync <= 0 {
		cfg.Resync = DefaultBundleResync
	}
	if cfg.Clock == nil {
		cfg.Clock = clock.RealClock{}
	}
	p := &ClusterTrustBundlePublisher{
		cfg:  cfg,
		name: pki.ClusterTrustBundleName(cfg.SignerName),
		log:  cfg.Logger,
		syncs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "tokenbroker_cluster_trust_bundle_syncs_total",
			Help: "Writes and checks of the published ClusterTrustBundle, by result.",
		}, []string{"result"}),
		inSync: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "tokenbroker_cluster_trust_bundle_in_sync",
			Help: "1 when the published ClusterTrustBundle holds what the broker serves, else 0.",
		}),
		notOwned: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "tokenbroker_cluster_trust_bundle_not_owned_total",
			Help: "Checks that found the ClusterTrustBundle of the broker's name made by someone else, and left it alone.",
		}),
	}
	if p.log == nil {
		p.log = zap.NewNop()
	}
	p.log = p.log.With(zap.String("cluster_trust_bundle", p.name), zap.String("signer", cfg.SignerName), zap.String("broker", cfg.Owner))
	if cfg.Registerer != nil {
		for _, c := range []prometheus.Collector{p.syncs, p.inSync, p.notOwned} {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, fmt.Errorf("cluster trust bundle metrics: %w", err)
			}
		}
	}
	return p, nil
}

// Name is the name of the bundle the publisher writes.
func (p *ClusterTrustBundlePublisher) Name() string { return p.name }

// Run checks every Interval and writes when the served CAs differ from
// what was last published, when Resync has passed, or (with capped
// exponential backoff) after a failure, until ctx is done. It is not safe
// to run twice at once.
func (p *ClusterTrustBundlePublisher) Run(ctx context.Context) {
	for {
		p.step(ctx)
		t := p.cfg.Clock.NewTimer(p.cfg.Interval)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
		}
	}
}

// step syncs if due.
func (p *ClusterTrustBundlePublisher) step(ctx context.Context) {
	now := p.cfg.Clock.Now()
	want := pki.EncodeCertificatesPEM(p.cfg.Bundle())
	changed := !bytes.Equal(want, p.published)
	if p.failures == 0 && !changed && now.Before(p.nextCheck) {
		return
	}
	if p.failures > 0 && now.Before(p.nextCheck) {
		return
	}
	if err := p.sync(ctx, want); err != nil {
		if ctx.Err() != nil {
			return
		}
		p.failures++
		backoff := min(bundleMinBackoff<<min(p.failures-1, 20), bundleMaxBackoff)
		p.nextCheck = now.Add(backoff)
		p.log.Error("publishing the ClusterTrustBundle failed; retrying",
			zap.Int("failures", p.failures), zap.Duration("retry_in", backoff), zap.Error(err))
		return
	}
	if p.failures > 0 {
		p.log.Info("ClusterTrustBundle published after failures", zap.Int("failures", p.failures))
	}
	p.failures = 0
	p.nextCheck = now.Add(p.cfg.Resync)
}

// Sync makes the bundle hold what the broker serves now, once.
func (p *ClusterTrustBundlePublisher) Sync(ctx context.Context) error {
	return p.sync(ctx, pki.EncodeCertificatesPEM(p.cfg.Bundle()))
}

func (p *ClusterTrustBundlePublisher) sync(ctx context.Context, want []byte) error {
	err := p.write(ctx, want)
	if err != nil {
		p.syncs.WithLabelValues("failure").Inc()
		p.inSync.Set(0)
		return err
	}
	p.syncs.WithLabelValues("success").Inc()
	p.inSync.Set(1)
	p.published = want
	return nil
}

func (p *ClusterTrustBundlePublisher) write(ctx context.Context, want []byte) error {
	if len(want) == 0 {
		// The API server refuses an empty bundle; it would also mean
		// "trust nothing", which no peer should be told.
		return errors.New("no CA certificate to publish")
	}
	cur, err := p.cfg.Client.Get(ctx, p.name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		_, err = p.cfg.Client.Create(ctx, &certificatesv1.ClusterTrustBundle{
			ObjectMeta: metav1.ObjectMeta{Name: p.name, Labels: map[string]string{objects.LabelManagedBy: objects.ManagedByValue},
				Annotations: map[string]string{AnnotationBroker: p.cfg.Owner}},
			Spec: certificatesv1.ClusterTrustBundleSpec{SignerName: p.cfg.SignerName, TrustBundle: string(want)},
		}, metav1.CreateOptions{FieldManager: fieldManager})
		if err != nil {
			return fmt.Errorf("create ClusterTrustBundle %s: %w", p.name, err)
		}
		p.log.Info("ClusterTrustBundle created", zap.Strings("cas", fingerprints(want)))
		return nil
	case err != nil:
		return fmt.Errorf("get ClusterTrustBundle %s: %w", p.name, err)
	}
	// The label says a broker made it, the annotation which one: a second
	// broker given the same signer must not take over the first one's
	// bundle, nor a bundle without the annotation.
	if cur.Labels[objects.LabelManagedBy] != objects.ManagedByValue || cur.Spec.SignerName != p.cfg.SignerName ||
		cur.Annotations[AnnotationBroker] != p.cfg.Owner {
		p.notOwned.Inc()
		return fmt.Errorf("ClusterTrustBundle %s (signer %q, %s=%q, %s=%q): %w; give each broker its own signer, or delete the bundle",
			p.name, cur.Spec.SignerName, objects.LabelManagedBy, cur.Labels[objects.LabelManagedBy], AnnotationBroker, cur.Annotations[AnnotationBroker], ErrBundleNotOwned)
	}
	if cur.Spec.TrustBundle == string(want) {
		return nil
	}
	next := cur.DeepCopy()
	next.Spec.TrustBundle = string(want)
	// The resourceVersion of the read makes this a compare-and-swap: a
	// replica that wrote in between makes this one fail with a conflict
	// and read again at its next try.
	if _, err := p.cfg.Client.Update(ctx, next, metav1.UpdateOptions{FieldManager: fieldManager}); err != nil {
		return fmt.Errorf("update ClusterTrustBundle %s: %w", p.name, err)
	}
	p.log.Info("ClusterTrustBundle updated", zap.Strings("cas", fingerprints(want)))
	return nil
}

// fieldManager names the broker's writes in managedFields.
const fieldManager = "tokenbroker"

func fingerprints(bundlePEM []byte) []string {
	certs, err := pki.ParseCertificatesPEM(bundlePEM)
	if err != nil {
		return nil
	}
	out := make([]string, 0, len(certs))
	for _, c := range certs {
		out = append(out, pki.Fingerprint(c))
	}
	return out
}

// PublishSources are the certificates PublishedCAs chooses from, as the
// broker holds them at one check.
type PublishSources struct {
	// ServingChain is --tls-cert-file: the serving leaf first, then the
	// intermediates the file carries.
	ServingChain []*x509.Certificate
	// ClientCAs is --client-ca-file. It may hold partner CAs, which
	// authenticate clients only and must never become anchors of this
	// broker's server certificate.
	ClientCAs []*x509.Certificate
	// Signing is --ca-cert-file, nil without one; Previous is
	// --previous-ca-cert-file during a rotation.
	Signing  *x509.Certificate
	Previous []*x509.Certificate
}

// PublishedCAs is what a broker publishes as its ClusterTrustBundle: the
// CAs that anchor this broker's own server certificate, and nothing else,
// because every CA in the bundle becomes an anchor that agents verify
// brokers with. That is
//
//   - the roots that the serving leaf (with the intermediates of its file)
//     verifies to for serverAuth at now, taken among the operator's CAs:
//     the client-CA bundle, the signing CA and the previous signing CA;
//   - the signing CA and the previous signing CA, so that during a
//     rotation agents already trust brokers whose server certificates
//     come from the new CA (and still those from the old one).
//
// A client-CA bundle CA that the serving certificate does not verify to —
// a partner CA — is never published: taken as an anchor, it could issue a
// server certificate for this broker's name. Intermediates of the serving
// chain are not published either: the broker sends them in its handshake,
// and as anchors they would shed their issuer's constraints; a chain CA
// that is not or does not chain to one of the operator's CAs (an ACME or
// corporate issuer) is not published at all. Non-CA certificates and
// duplicates are left out (the API server refuses both).
//
// ok is false when the serving leaf verifies to none of the operator's
// CAs: agents that trust only the bundle would then refuse the broker,
// which the caller should say.
func PublishedCAs(src PublishSources, now time.Time) (cas []*x509.Certificate, ok bool) {
	isCA := func(c *x509.Certificate) bool { return c != nil && c.BasicConstraintsValid && c.IsCA }
	add := func(c *x509.Certificate) {
		if isCA(c) && !containsCertificate(cas, c) {
			cas = append(cas, c)
		}
	}
	roots := x509.NewCertPool()
	var operator []*x509.Certificate
	for _, c := range append(append(slices.Clone(src.ClientCAs), src.Signing), src.Previous...) {
		if isCA(c) {
			roots.AddCert(c)
			operator = append(operator, c)
		}
	}
	if len(src.ServingChain) > 0 && len(operator) > 0 {
		inter := x509.NewCertPool()
		for _, c := range src.ServingChain[1:] {
			inter.AddCert(c)
		}
		chains, err := src.ServingChain[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, CurrentTime: now,
			KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}})
		if err == nil {
			for _, chain := range chains {
				// The last certificate of a chain is from roots, so one
				// of the operator's; anything before it is an
				// intermediate.
				if root := chain[len(chain)-1]; containsCertificate(operator, root) {
					add(root)
					ok = true
				}
			}
		}
	}
	add(src.Signing)
	for _, c := range src.Previous {
		add(c)
	}
	return cas, ok
}

func containsCertificate(certs []*x509.Certificate, c *x509.Certificate) bool {
	for _, x := range certs {
		if x.Equal(c) {
			return true
		}
	}
	return false
}
